"""Compiled predict and test steps and their traced outputs."""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf

from keras_memfit._internal import keras_compat as _keras_compat
from keras_memfit.backend.base import NO_SPEC, Spec
from keras_memfit.backend.tensorflow import distribution
from keras_memfit.backend.tensorflow.compiling import (
    needs_static_batch, relaxed_spec, traced_as_keras,
)


def make_predict_step(
    model: keras.Model, postprocess: Optional[Callable] = None
) -> Callable:
    """Compiled; under a `MirroredStrategy` each replica runs its share of `x` (`distribution`)."""
    model_ref = weakref.ref(model)

    def predict_step(x):
        outputs = model_ref().predict_step((x,))
        if postprocess is not None:
            outputs = postprocess(outputs)
        return outputs

    return distribution.distributed_step(model, predict_step, how="concat")


# Keras's own `evaluate` on TensorFlow runs its test step on a tf.data
# iterator whose batch dimension is unknown, so each per-output loss tracker
# counts every batch once, whatever its size (`safe_evaluate` matches it).
KERAS_COUNTS_EACH_BATCH_ONCE = True
# Keras's TensorFlow loops call `on_*_batch_begin`, then fetch the batch.
KERAS_BEGINS_BATCH_BEFORE_FETCH = True


def make_test_step(model: keras.Model, exact: bool = False) -> Callable:
    """Traced once with an unknown batch size, as Keras's `evaluate` (`exact`: once per size)."""
    model_ref = weakref.ref(model)

    def test_step(data):
        return model_ref().test_step(data)

    step = distribution.distributed_step(
        model, test_step, how="mean", static_shapes=exact and needs_static_batch(model)
    )
    return step if exact else traced_as_keras(step)


def prepare_test(model: keras.Model, batch: Any) -> None:
    """Under a `MirroredStrategy`, inside its scope, so the metrics get one copy per replica."""
    x, y, sample_weight = batch
    strategy = distribution.strategy_of(model)
    with contextlib.nullcontext() if strategy is None else strategy.scope():
        _keras_compat.symbolic_build(model, (x, y, sample_weight))


def guard_variables(variables: Sequence[Any]) -> distribution.VariableGuard:
    """Every copy of each variable (one per replica under a strategy): `VariableGuard`."""
    return distribution.VariableGuard(variables)


def output_spec(step: Callable, x: Any) -> Optional[Any]:
    """`NO_SPEC` for eager steps; traced once, with an unknown batch dimension."""
    polymorphic = tf.types.experimental.PolymorphicFunction
    if not isinstance(step, polymorphic):
        step = getattr(step, "__wrapped__", None)  # a functools.wraps wrapper
        if not isinstance(step, polymorphic):
            return NO_SPEC
    outputs = step.get_concrete_function(relaxed_spec(x)).structured_outputs

    def describe(leaf):
        if isinstance(leaf, (tf.RaggedTensor, tf.SparseTensor)):
            return Spec(None, np.dtype(leaf.dtype.as_numpy_dtype))
        if not tf.is_tensor(leaf):
            return leaf
        shape = tuple(leaf.shape.as_list()) if leaf.shape.rank is not None else None
        return Spec(shape, np.dtype(leaf.dtype.as_numpy_dtype))

    return keras.tree.map_structure(describe, outputs)
