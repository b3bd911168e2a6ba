"""MemFit's train steps on TensorFlow: each tells how far a failed call got (docs/backends.md)."""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import keras
import numpy as np
import tensorflow as tf

from keras_memfit._internal.cache import per_model
from keras_memfit._internal.model_state import train_state_variables
from keras_memfit.backend.base import StepOutcome
from keras_memfit.backend.tensorflow.accumulation import AccumulationSteps, GradientAccumulator
from keras_memfit.backend.tensorflow.default_step import (
    flagged_train_step,
    loss_and_gradients,
    ordered_after,
    track_loss,
)
from keras_memfit.backend.tensorflow.xla_holds import XlaHolds
from keras_memfit.backend.tensorflow.compiling import compile_step, trace_as_keras
from keras_memfit.backend.tensorflow.distribution import step_variant
from keras_memfit.backend.tensorflow.keras_functions import keras_batch_spec

logger = logging.getLogger("keras_memfit")


# The strict order is used where it costs at most this share of the estimated peak.
STRICT_SHARE = 0.02


class TrainStep:
    """Keras's default train step, compiled, that tells how far a failed call got (`last_outcome`).

    Each call snapshots `guarded` and bumps `generation`, then sets `update_began` before the
    update: in the strict order once every gradient exists, else at the first. Under XLA
    (`split`) it runs as a gradient call and an update call.
    """

    snapshots_itself = True

    def __init__(self, model: keras.Model, guarded: Sequence[Any],
                 peak_at: Optional[Callable[[int], Optional[int]]] = None) -> None:
        self.update_began = tf.Variable(0, dtype=tf.int64, trainable=False)
        self.generation = tf.Variable(0, dtype=tf.int64, trainable=False)
        self._completed = 0  # generations the host knows have run
        self.last_outcome: Optional[StepOutcome] = None
        self.always_strict = False
        sizes = [_nbytes(w) for w in model.trainable_weights]
        self.strict_extra_bytes = sum(sizes) - max(sizes, default=0)
        self._peak_at = peak_at
        self._guarded = list(guarded)
        self._shadows = []
        for v in self._guarded:
            with tf.device(v.value.device):
                self._shadows.append(tf.Variable(v.value, trainable=False))
        self._model = weakref.ref(model)
        self._steps: Dict[bool, Callable] = {}  # strict -> compiled step, made on first use
        self._holds = XlaHolds(
            model,
            small=lambda: self._guarded + self._shadows + [self.generation, self.update_began],
            large=lambda: [],
        )
        self.split = self._holds.active
        self._split_steps: Optional[Tuple[Callable, Callable]] = None  # made on first use
        self._traced: Dict[int, Any] = {}  # id(step) -> the Keras batch spec it was traced for

    def strict_at(self, rows: Optional[int]) -> bool:
        """Whether a call on `rows` rows runs in the strict order."""
        if self.always_strict or self._peak_at is None or rows is None:
            return True
        try:
            peak = self._peak_at(rows)
            two = self._peak_at(2) if rows == 1 else None
        except Exception as exc:  # the estimate is advisory
            logger.debug("MemFit: no peak estimate (%s); the train step runs strict", exc)
            peak = None
        if peak is None:
            self._peak_at = None
            return True
        if self.strict_extra_bytes <= STRICT_SHARE * peak:
            return True
        # At one row: strict where the gradients cost less than one row (what recomputation frees).
        return two is not None and self.strict_extra_bytes < two - peak

    def __call__(self, data: Any) -> Dict[str, Any]:
        if self.split:
            return self._call_split(data)
        strict = self.strict_at(_host_rows(data))
        step = self._steps.get(strict)
        if step is None:
            step = self._steps[strict] = _make_train_step(
                self._model(), self.update_began, self.generation,
                list(zip(self._shadows, self._guarded)), strict,
            )
        return self._run(step, (strict, data), data)

    def _call_split(self, data: Any) -> Dict[str, Any]:
        """The gradient call (small state held), then the in-place update call."""
        if self._split_steps is None:
            self._split_steps = _make_split_steps(
                self._model(), self.generation, list(zip(self._shadows, self._guarded)))
        gradient_step, update_step = self._split_steps
        gradients, logs = self._run(gradient_step, data, data)
        try:
            update_step(gradients)
        except Exception:
            self.last_outcome = StepOutcome.UPDATE_BEGAN  # its donated buffers may be gone
            raise
        return logs

    def _run(self, step: Callable, held_for: Any, data: Any) -> Any:
        """`step(data)`, traced as Keras's; after a failure `last_outcome` says how far it got."""
        self._trace(step, data)
        try:
            with self._holds.holding(held_for):
                result = step(data)
        except Exception:
            self.last_outcome = self._settle()
            raise
        except BaseException:  # KeyboardInterrupt: whatever ran, ran
            self._completed = int(self.generation.numpy())
            raise
        self._completed += 1
        return result

    def _trace(self, step: Callable, data: Any) -> None:
        """`trace_as_keras` on Keras's current batch spec, once per step and spec."""
        spec = keras_batch_spec(self._model())
        if id(step) not in self._traced or self._traced[id(step)] is not spec:
            trace_as_keras(step, data, spec)
            self._traced[id(step)] = spec

    def _settle(self) -> StepOutcome:
        generation = int(self.generation.numpy())
        if generation == self._completed:
            self.always_strict = True
            return StepOutcome.UNTOUCHED
        self._completed = generation
        for shadow, v in zip(self._shadows, self._guarded):
            v.assign(shadow)
        if int(self.update_began.numpy()) == generation:
            return StepOutcome.UPDATE_BEGAN
        self.always_strict = True
        return StepOutcome.RESTORED


def _nbytes(variable: Any) -> int:
    return int(np.prod(variable.shape)) * tf.as_dtype(variable.dtype).size


def _host_rows(data: Any) -> Optional[int]:
    """The rows of a Keras batch, read on the host (None when unknown)."""
    for item in keras.tree.flatten(data):
        shape = getattr(item, "shape", None)
        if shape is not None and len(shape) and shape[0] is not None:
            return int(shape[0])
    return None


def make_train_step(
    model: keras.Model, peak_at: Optional[Callable[[int], Optional[int]]] = None
) -> TrainStep:
    """A `TrainStep` guarding `train_state_variables(model)`, its order chosen by `peak_at`."""
    return TrainStep(model, train_state_variables(model), peak_at)


def _after_snapshot(data: Any, generation: Any, pairs: Sequence[Tuple[Any, Any]]) -> Any:
    """`data`, ordered after `pairs`' snapshot (`shadow <- value`) and `generation`'s bump."""
    reads = [shadow.assign(v.value) for shadow, v in pairs]
    with tf.control_dependencies(reads):
        bumped = generation.assign_add(1)
    return ordered_after(bumped, data)


def _make_train_step(
    model: keras.Model, update_began, generation, pairs, strict: bool
) -> Callable:
    model_ref = weakref.ref(model)

    def train_step(data):
        model = model_ref()
        data = _after_snapshot(data, generation, pairs)
        return flagged_train_step(
            model, data, lambda: update_began.assign(generation.read_value()), strict=strict
        )

    return compile_step(model, train_step)


def _make_split_steps(model: keras.Model, generation, pairs) -> Tuple[Callable, Callable]:
    """Keras's default step as two compiled calls: `data -> (gradients, logs)`, then the update."""
    model_ref = weakref.ref(model)
    present: List[bool] = []  # per trainable weight: whether it gets a gradient (at trace)

    def gradient_step(data):
        model = model_ref()
        data = _after_snapshot(data, generation, pairs)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred, loss, gradients = loss_and_gradients(model, x, y, sample_weight)
        present[:] = [g is not None for g in gradients]
        track_loss(model, loss, x)
        logs = model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        return [g for g in gradients if g is not None], logs

    def update_step(gradients):
        model = model_ref()
        weights = [w for w, p in zip(model.trainable_weights, present) if p]
        model.optimizer.apply_gradients(zip(gradients, weights))

    return compile_step(model, gradient_step), compile_step(model, update_step)


class CustomTrainStep:
    """A model's own `train_step`, compiled and traced when made; callers guard the small state."""

    snapshots_itself = False
    last_outcome: Optional[StepOutcome] = None

    def __init__(self, model: keras.Model, data: Any) -> None:
        model_ref = weakref.ref(model)

        def train_step(data):
            return model_ref().train_step(data)

        self._step = compile_step(model, train_step)
        trace_as_keras(self._step, data, keras_batch_spec(model))
        self._holds = XlaHolds(
            model, small=lambda: train_state_variables(model_ref()),
            large=lambda: _updated_by_a_step(model_ref()),
        )

    def __call__(self, data: Any) -> Dict[str, Any]:
        with self._holds.holding(data):
            return self._step(data)


def checkpoint(fn: Callable) -> Callable:
    """`tf.recompute_grad` over `fn`'s floating inputs (the others are closed over)."""

    def call(*args: Any) -> Any:
        floating = [i for i, arg in enumerate(args) if arg.dtype.is_floating]

        def of_floating(*values: Any) -> Any:
            full = list(args)
            for i, value in zip(floating, values):
                full[i] = value
            return fn(*full)

        return tf.recompute_grad(of_floating)(*[args[i] for i in floating])

    return call


def make_custom_train_step(model: keras.Model, data: Any) -> CustomTrainStep:
    """A `CustomTrainStep`, traced on Keras's batch `data`."""
    return CustomTrainStep(model, data)


def _updated_by_a_step(model: keras.Model) -> List[Any]:
    optimizer = getattr(model, "optimizer", None)
    return list(model.variables) + (list(optimizer.variables) if optimizer is not None else [])


def make_accumulator(model: keras.Model) -> GradientAccumulator:
    """A `GradientAccumulator` on the model's cached `AccumulationSteps`."""
    key = (
        "accumulation steps",
        step_variant(model),
        id(model.optimizer),
        tuple(id(v) for v in model.trainable_weights),
        bool(getattr(model, "run_eagerly", False)),
        model.jit_compile,
    )
    steps = per_model(model, key, lambda: AccumulationSteps(model))
    if steps.in_use:
        steps = AccumulationSteps(model)
    steps.in_use = True
    return GradientAccumulator(model, steps)
