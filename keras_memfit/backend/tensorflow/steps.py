"""Compiled predict and test steps, their traced outputs, and variable guards."""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf

from keras_memfit._internal import keras_compat as _keras_compat
from keras_memfit.backend.base import NO_SPEC, Spec
from keras_memfit.backend.tensorflow import replicas


def _compile(model: keras.Model, fn: Callable, static_shapes: bool = False) -> Callable:
    """`fn` compiled as Keras would compile the model's own steps.

    `fn` reaches the model through a weak reference, so that a step cached per model does not keep
    it alive. `static_shapes` traces once per piece size (see `_needs_static_batch`).
    """
    if getattr(model, "run_eagerly", False):
        return fn
    return tf.function(
        fn, reduce_retracing=not static_shapes, jit_compile=bool(model.jit_compile)
    )


def _needs_static_batch(model: keras.Model) -> bool:
    """Whether a step that splits batches must be traced with a static batch size.

    Keras weights each per-output loss tracker by the outputs' static batch size: traced with an
    unknown one, pieces of different sizes would count alike.
    """
    return _keras_compat.has_per_output_loss_trackers(model)


def make_predict_step(
    model: keras.Model, postprocess: Optional[Callable] = None
) -> Callable:
    """Compiled; under a `MirroredStrategy` each replica runs its share of `x` (`replicas`)."""
    model_ref = weakref.ref(model)

    def predict_step(x):
        outputs = model_ref().predict_step((x,))
        if postprocess is not None:
            outputs = postprocess(outputs)
        return outputs

    strategy = replicas.strategy_of(model)
    if strategy is not None:
        return replicas.distributed_step(model, strategy, predict_step, how="concat")
    return _compile(model, predict_step)


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

    strategy = replicas.strategy_of(model)

    def compile_step(static_shapes: bool = False) -> Callable:
        if strategy is not None:
            return replicas.distributed_step(
                model, strategy, test_step, how="mean", static_shapes=static_shapes
            )
        return _compile(model, test_step, static_shapes=static_shapes)

    if exact:
        return compile_step(static_shapes=_needs_static_batch(model))
    return traced_as_keras(compile_step())


def traced_as_keras(step: Callable) -> Callable:
    """Compiled `step`, traced on its first call as Keras traces its own (`trace_as_keras`)."""
    if not isinstance(step, tf.types.experimental.PolymorphicFunction):
        return step  # run eagerly: shapes are always static
    traced = []

    def relaxed_step(data):
        if not traced:
            trace_as_keras(step, data)
            traced.append(True)
        return step(data)

    relaxed_step.__wrapped__ = step
    return relaxed_step


def trace_as_keras(step: Callable, data: Any, spec: Any = None) -> None:
    """Trace compiled `step` for `data` as Keras traces its own (nothing for an eager step).

    On `spec` (Keras's dataset element spec) where `data` fits it, else with an unknown batch
    dimension, so that per-output loss trackers see the static batch size they see in Keras.
    """
    if isinstance(step, tf.types.experimental.PolymorphicFunction):
        step.get_concrete_function(spec if _fits(data, spec) else relaxed_spec(data))


def _fits(data: Any, spec: Any) -> bool:
    """Whether `data` (a structure of values) fits the type spec structure `spec`."""
    if spec is None:
        return False
    try:
        tf.nest.assert_same_structure(data, spec)
    except (ValueError, TypeError):
        return False
    for value, leaf in zip(tf.nest.flatten(data), tf.nest.flatten(spec)):
        if (value is None) != (leaf is None):
            return False
        if value is not None and not leaf.is_compatible_with(value):
            return False
    return True


def relaxed_spec(value: Any) -> Any:
    """The type spec of `value` (a structure) with an unknown batch dimension.

    Numpy object arrays are string tensors; None stays None; a `tf.distribute` value, per replica.
    """

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


class VariableGuard:
    """A `Guard`: copies of some variables on their own devices, taken by one compiled call.

    Take the snapshot before each attempt: a failed step may have updated some of them, or none.
    """

    def __init__(self, variables: Sequence[Any]) -> None:
        self._variables = list(variables)
        self._shadows = []
        for v in self._variables:
            with tf.device(v.value.device):
                self._shadows.append(tf.Variable(v.value, trainable=False))
        pairs = list(zip(self._shadows, self._variables))

        @tf.function
        def snapshot():
            for shadow, v in pairs:
                shadow.assign(v.value)

        self._snapshot = snapshot if pairs else None

    def snapshot(self) -> None:
        if self._snapshot is not None:
            self._snapshot()

    def restore(self) -> None:
        for shadow, v in zip(self._shadows, self._variables):
            v.assign(shadow)


def guard_variables(variables: Sequence[Any]) -> Any:
    """A `VariableGuard`, or a `replicas.ReplicaGuard` for tf.distribute variables."""
    if replicas.has_distributed(variables):
        return replicas.ReplicaGuard(variables)
    return VariableGuard(variables)


def prepare_test(model: keras.Model, batch: Any) -> None:
    """Under a `MirroredStrategy`, inside its scope, so the metrics get one copy per replica."""
    x, y, sample_weight = batch
    strategy = replicas.strategy_of(model)
    if strategy is None:
        _keras_compat.symbolic_build(model, (x, y, sample_weight))
        return
    with strategy.scope():
        _keras_compat.symbolic_build(model, (x, y, sample_weight))


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
