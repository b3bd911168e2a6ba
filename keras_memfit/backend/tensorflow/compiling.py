"""Compiling and tracing MemFit's TensorFlow steps as Keras does its own."""

from __future__ import annotations

from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf

from keras_memfit._internal import keras_compat as _keras_compat


def compile_step(model: keras.Model, fn: Callable, static_shapes: bool = False) -> Callable:
    """`fn` compiled as Keras would compile the model's own steps."""
    if getattr(model, "run_eagerly", False):
        return fn
    return tf.function(
        fn, reduce_retracing=not static_shapes, jit_compile=bool(model.jit_compile)
    )


def needs_static_batch(model: keras.Model) -> bool:
    """Whether a step that splits batches must be traced with a static batch size.

    Keras weights each per-output loss tracker by the outputs' static batch size.
    """
    return _keras_compat.has_per_output_loss_trackers(model)


def traced_as_keras(step: Callable) -> Callable:
    """Compiled `step`, traced on its first call as Keras traces its own (`trace_as_keras`)."""
    if not isinstance(step, tf.types.experimental.PolymorphicFunction):
        return step  # run eagerly
    traced = []

    def relaxed_step(data):
        if not traced:
            trace_as_keras(step, data)
            traced.append(True)
        return step(data)

    relaxed_step.__wrapped__ = step
    return relaxed_step


def trace_as_keras(step: Callable, data: Any, spec: Any = None) -> None:
    """Trace compiled `step` on Keras's `spec` where `data` fits it, else on `relaxed_spec`."""
    if isinstance(step, tf.types.experimental.PolymorphicFunction):
        step.get_concrete_function(spec if _fits(data, spec) else relaxed_spec(data))


def _fits(data: Any, spec: Any) -> bool:
    if spec is None:
        return False
    try:
        tf.nest.assert_same_structure(data, spec)
    except (ValueError, TypeError):
        return False
    return all(
        (value is None) == (leaf is None) and (value is None or leaf.is_compatible_with(value))
        for value, leaf in zip(tf.nest.flatten(data), tf.nest.flatten(spec))
    )


def relaxed_spec(value: Any) -> Any:
    """The type spec of `value` (a structure) with an unknown batch dimension."""

    def spec(leaf):
        if leaf is None:
            return None
        if isinstance(leaf, tf.distribute.DistributedValues):
            return type(tf.type_spec_from_value(leaf))(*[spec(v) for v in leaf.values])
        if isinstance(leaf, np.ndarray) and leaf.dtype == object:
            return tf.TensorSpec((None,) + leaf.shape[1:], tf.string)
        if not isinstance(leaf, (tf.Tensor, tf.RaggedTensor, tf.SparseTensor)):
            leaf = tf.convert_to_tensor(leaf)
        shape = (None,) + tuple(leaf.shape[1:])
        if isinstance(leaf, tf.RaggedTensor):
            return tf.RaggedTensorSpec(
                shape, leaf.dtype, leaf.ragged_rank, leaf.row_splits.dtype
            )
        if isinstance(leaf, tf.SparseTensor):
            return tf.SparseTensorSpec(shape, leaf.dtype)
        return tf.TensorSpec(shape, leaf.dtype)

    return keras.tree.map_structure(spec, value)
