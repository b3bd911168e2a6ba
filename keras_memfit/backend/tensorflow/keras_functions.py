"""Keras's step functions in the TensorFlow trainer's calling convention."""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterator, List, Optional

import keras
import tensorflow as tf
from keras.src.trainers.data_adapters import data_adapter_utils

from keras_memfit._internal import batches as _batches
from keras_memfit.backend.base import KerasCall, check_step_kind


def keras_call(model: keras.Model, kind: str, *args: Any) -> KerasCall:
    """`args`: `(iterator,)` for "train" and "test", `(batches,)` Keras pulled for "predict"."""
    check_step_kind(kind)
    (batches,) = args
    if kind == "predict":
        return KerasCall(list(batches))
    if kind == "train":
        _KERAS_SPECS[model] = getattr(batches, "element_spec", None)
    return KerasCall(_batches.pull_batches(batches, model.steps_per_execution, is_end_of_data))


# model -> the element spec of the iterator Keras last handed its train function.
_KERAS_SPECS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def keras_batch_spec(model: keras.Model) -> Optional[Any]:
    """The spec Keras traces `model`'s train step on (its data's element spec), or None."""
    return _KERAS_SPECS.get(model)


def _as_tf_sparse(value: Any) -> Any:
    """A scipy or JAX sparse matrix as a `tf.SparseTensor`, as Keras's adapter makes it."""
    if data_adapter_utils.is_scipy_sparse(value):
        return data_adapter_utils.scipy_sparse_to_tf_sparse(value)
    if data_adapter_utils.is_jax_sparse(value):
        return data_adapter_utils.jax_sparse_to_tf_sparse(value)
    return value


def adapter_batches(adapter: Any) -> Iterator[Any]:
    """As Keras's TensorFlow loops hand them over: tensors from `tf.data`, else numpy arrays."""
    if type(adapter).__name__ in ("TFDatasetAdapter", "ArrayDataAdapter"):
        return iter(adapter.get_tf_dataset())
    return (
        keras.tree.map_structure(_as_tf_sparse, batch)
        for batch in adapter.get_numpy_iterator()
    )


def call_keras_function(
    model: keras.Model, kind: str, function: Callable[..., Any], batches: List[Any]
) -> Any:
    """The predict function takes the list of batches, the others an iterator."""
    return function(batches if kind == "predict" else iter(batches))


def is_end_of_data(exc: BaseException) -> bool:
    return isinstance(exc, (StopIteration, tf.errors.OutOfRangeError))

