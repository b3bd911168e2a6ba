"""TensorFlow implementation of the backend seam (see `keras_memfit.backend.base`).

One module per concern, the same names in every backend package: `oom`,
`memory`, `steps`, `training`, `trainer`, `devices`, `tracing`. This module
exports the names of the `Backend` protocol.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional, Sequence, Tuple

import keras
import numpy as np
import tensorflow as tf

from keras_memfit._model_state import train_state_variables
from keras_memfit.backend.tensorflow.devices import (
    call_on_device,
    canonical_device,
    creating_on,
    device_exists,
    device_scope,
    follow_variable_devices,
    host_device,
    list_accelerators,
    move_variable,
    variable_device,
)
from keras_memfit.backend.tensorflow.memory import (
    compute_device,
    memory_limit,
    memory_stats,
    reset_peak,
)
from keras_memfit.backend.tensorflow.oom import init_oom_error, is_oom_error, oom_error_bases
from keras_memfit.backend.tensorflow.steps import (
    VariableGuard,
    _compile,
    _needs_static_batch,
    guard_variables,
    make_predict_step,
    make_test_step,
    output_spec,
    prepare_test,
)
from keras_memfit.backend.tensorflow.tracing import trace_layer_calls

# --------------------------------------------------------------------------
# Training (MemFit)
# --------------------------------------------------------------------------
def _default_train_step() -> Callable:
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    return TensorFlowTrainer.train_step


def has_default_train_step(model: keras.Model) -> bool:
    """Whether `model` uses Keras's own `train_step` (no override)."""
    return getattr(type(model).train_step, "__code__", None) is getattr(
        _default_train_step(), "__code__", object()
    )


def uses_distribution(model: keras.Model) -> bool:
    """Whether `model` was built under a tf.distribute strategy."""
    return getattr(model, "_distribute_strategy", None) is not None or tf.distribute.has_strategy()




def _unpack(data):
    return keras.utils.unpack_x_y_sample_weight(data)


def _rows(x) -> Any:
    return tf.shape(next(i for i in keras.tree.flatten(x) if i is not None))[0]


def _forward_loss(model: keras.Model, x, y, sample_weight):
    if model._call_has_training_arg:
        y_pred = model(x, training=True)
    else:
        y_pred = model(x)
    loss = model._compute_loss(
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
    )
    return y_pred, loss


def _unscaled(loss):
    from keras.src.losses import loss as loss_module

    return loss_module.unscale_loss_for_distribution(loss)


class TrainStep:
    """Keras's default train step, compiled, that can tell how far a failed step got.

    Same computation as `TensorFlowTrainer.train_step`, plus, inside the same
    compiled function (no extra call per step):

    - a snapshot of `guarded` (the small state a step updates: see
      `train_state_variables`) into shadow variables, then a bump of
      `generation`; the forward pass depends on both, so nothing that needs
      memory runs before them;
    - control dependencies so that no weight or slot is updated before every
      gradient exists, and `update_started`, set to 1 right before the
      optimizer update begins.

    When a call raises an `Exception`, the step reads the two counters (host
    reads, only then), restores the small state if the snapshot had run, and
    sets `last_outcome`: `UNTOUCHED` (nothing ran: XLA, for one, allocates
    before it executes anything), `RESTORED` (it ran part-way; its small state
    is back), or `UPDATE_BEGAN` (the optimizer update had begun: weights may be
    partly updated, so the step must not be retried).
    """

    UNTOUCHED = "untouched"
    RESTORED = "restored"
    UPDATE_BEGAN = "update_began"

    def __init__(self, model: keras.Model, guarded: Sequence[Any]) -> None:
        self.update_started = tf.Variable(0, dtype=tf.int32, trainable=False)
        self.generation = tf.Variable(0, dtype=tf.int64, trainable=False)
        self._completed = 0  # generations the host knows have run
        self.last_outcome: Optional[str] = None
        self._guarded = list(guarded)
        self._shadows = []
        for v in self._guarded:
            with tf.device(v.value.device):
                self._shadows.append(tf.Variable(v.value, trainable=False))
        self._step = _make_train_step(
            model, self.update_started, self.generation, list(zip(self._shadows, self._guarded))
        )

    def __call__(self, data: Any) -> Any:
        try:
            logs = self._step(data)
        except Exception:
            self.last_outcome = self._settle()
            raise
        except BaseException:  # KeyboardInterrupt: whatever ran, ran
            self._completed = int(self.generation.numpy())
            raise
        self._completed += 1
        return logs

    def _settle(self) -> str:
        generation = int(self.generation.numpy())
        if generation == self._completed:
            return self.UNTOUCHED
        self._completed = generation
        for shadow, v in zip(self._shadows, self._guarded):
            v.assign(shadow)
        return self.UPDATE_BEGAN if int(self.update_started.numpy()) else self.RESTORED


def make_train_step(model: keras.Model) -> TrainStep:
    """A `TrainStep` for `model`, guarding `train_state_variables(model)`."""
    return TrainStep(model, train_state_variables(model))


def _make_train_step(model: keras.Model, update_started, generation, pairs) -> Callable:
    model_ref = weakref.ref(model)

    def train_step(data):
        model = model_ref()
        reads = [shadow.assign(v.value) for shadow, v in pairs]
        with tf.control_dependencies(reads):
            reset = update_started.assign(0)
        with tf.control_dependencies(reads + [reset]):
            bumped = generation.assign_add(1)
        with tf.control_dependencies([bumped]):
            data = keras.tree.map_structure(
                lambda t: None if t is None else tf.identity(t), data
            )
        x, y, sample_weight = _unpack(data)
        with tf.GradientTape() as tape:
            y_pred, loss = _forward_loss(model, x, y, sample_weight)
            scaled = model.optimizer.scale_loss(loss) if model.optimizer is not None else loss
        weights = model.trainable_weights
        if weights:
            gradients = tape.gradient(scaled, weights)
            with tf.control_dependencies([g for g in gradients if g is not None]):
                started = update_started.assign(1)
            with tf.control_dependencies([started]):
                gradients = [None if g is None else tf.identity(g) for g in gradients]
            model.optimizer.apply_gradients(zip(gradients, weights))
        model._loss_tracker.update_state(_unscaled(loss), sample_weight=_rows(x))
        return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    return _compile(model, train_step)



def next_batches(iterator: Any, count: int) -> list:
    """Up to `count` batches from a Keras epoch iterator (StopIteration at the end)."""
    batches = []
    for _ in range(count):
        try:
            batches.append(next(iterator))
        except (StopIteration, tf.errors.OutOfRangeError):
            if batches:
                break
            raise
    return batches


def make_custom_train_step(model: keras.Model) -> Callable:
    """The model's own (overridden) `train_step`, compiled as Keras would."""
    model_ref = weakref.ref(model)

    def train_step(data):
        return model_ref().train_step(data)

    return _compile(model, train_step)


class GradientAccumulator:
    """Sums weighted micro-batch gradients in place and applies them once.

    The sums live in one non-trainable variable per trainable weight, created
    on first use (they cost the size of the weights, only once a batch has
    had to be split), so adding a micro-batch's gradients allocates nothing
    beyond the gradients themselves.
    """

    def __init__(self, model: keras.Model) -> None:
        model_ref = weakref.ref(model)
        self._weights = list(model.trainable_weights)
        self._sums = []
        for w in self._weights:
            with tf.device(w.value.device):
                self._sums.append(tf.Variable(tf.zeros_like(w.value), trainable=False))
        # Which weights get no gradient is known when the step is traced.
        traced = {"mask": tuple(False for _ in self._weights)}
        self._traced = traced
        sums = self._sums

        def add_step(data, weight):
            model = model_ref()
            x, y, sample_weight = _unpack(data)
            with tf.GradientTape() as tape:
                y_pred, loss = _forward_loss(model, x, y, sample_weight)
                scaled = model.optimizer.scale_loss(loss) * tf.cast(weight, loss.dtype)
            gradients = tape.gradient(scaled, model.trainable_weights)
            for total, g in zip(sums, gradients):
                if isinstance(g, tf.IndexedSlices):
                    total.scatter_add(g)
                elif g is not None:
                    total.assign_add(g)
            model._loss_tracker.update_state(_unscaled(loss), sample_weight=_rows(x))
            model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
            traced["mask"] = tuple(g is None for g in gradients)

        def apply_step(mask):
            model = model_ref()
            pairs = [
                (total.read_value(), w)
                for total, w, missing in zip(sums, model.trainable_weights, mask)
                if not missing
            ]
            model.optimizer.apply_gradients(pairs)

        @tf.function
        def reset():
            for total in sums:
                total.assign(tf.zeros_like(total))

        self._add = _compile(model, add_step, static_shapes=_needs_static_batch(model))
        self._apply = _compile(model, apply_step)
        self._reset = reset

    def reset(self) -> None:
        """Start a new batch: zero the sums."""
        self._reset()

    def add(self, data: Any, weight: float) -> None:
        """Add `weight` times the gradient of the loss on micro-batch `data`."""
        self._add(data, tf.constant(weight, tf.float64))  # cast to the loss dtype inside

    def apply(self) -> None:
        """Apply the summed gradients as one optimizer step."""
        self._apply(self._traced["mask"])


def make_accumulator(model: keras.Model) -> GradientAccumulator:
    return GradientAccumulator(model)
