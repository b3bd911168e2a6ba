"""Train steps that can tell how far a failed call got, and gradient accumulation.

MemFit's building blocks for the TensorFlow backend: `make_train_step` (Keras's
default step, with its small state snapshotted inside the same compiled call),
`make_custom_train_step` (a model's own `train_step`), `make_accumulator`
(micro-batch gradients summed and applied as one optimizer step), and the
checks `has_default_train_step` and `uses_distribution`. Every returned
object satisfies its protocol in `keras_memfit.backend.base`.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import keras
import tensorflow as tf

from keras_memfit import _keras_compat
from keras_memfit._model_state import train_state_variables
from keras_memfit.backend.base import StepOutcome
from keras_memfit.backend.tensorflow.steps import _compile, _needs_static_batch


def has_default_train_step(model: keras.Model) -> bool:
    """Whether `model` uses Keras's own `train_step` (no override)."""
    return getattr(type(model).train_step, "__code__", None) is getattr(
        _keras_compat.tensorflow_train_step(), "__code__", object()
    )


def uses_distribution(model: keras.Model) -> bool:
    """Whether `model` was built under a tf.distribute strategy."""
    return (
        _keras_compat.distribute_strategy(model) is not None or tf.distribute.has_strategy()
    )


def _unpack(data: Any) -> tuple:
    return keras.utils.unpack_x_y_sample_weight(data)


def _rows(x: Any) -> Any:
    return tf.shape(next(i for i in keras.tree.flatten(x) if i is not None))[0]


def _forward_loss(model: keras.Model, x: Any, y: Any, sample_weight: Any) -> tuple:
    if _keras_compat.call_has_training_arg(model):
        y_pred = model(x, training=True)
    else:
        y_pred = model(x)
    return y_pred, _keras_compat.compute_loss(model, x, y, y_pred, sample_weight)


def _track_loss(model: keras.Model, loss: Any, x: Any) -> None:
    """Update the loss tracker as Keras's train step does."""
    _keras_compat.loss_tracker(model).update_state(
        _keras_compat.unscale_loss_for_distribution(loss), sample_weight=_rows(x)
    )


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
    sets `last_outcome` to a `StepOutcome`: `UNTOUCHED` (nothing ran: XLA,
    for one, allocates before it executes anything), `RESTORED` (it ran
    part-way; its small state is back), or `UPDATE_BEGAN` (the optimizer
    update had begun: weights may be partly updated, so the step must not be
    retried).

    Attributes:
        snapshots_itself: True: callers need no `Guard` around a call.
        last_outcome: The outcome of the last call that raised, or None.
    """

    snapshots_itself = True

    def __init__(self, model: keras.Model, guarded: Sequence[Any]) -> None:
        self.update_started = tf.Variable(0, dtype=tf.int32, trainable=False)
        self.generation = tf.Variable(0, dtype=tf.int64, trainable=False)
        self._completed = 0  # generations the host knows have run
        self.last_outcome: Optional[StepOutcome] = None
        self._guarded = list(guarded)
        self._shadows = []
        for v in self._guarded:
            with tf.device(v.value.device):
                self._shadows.append(tf.Variable(v.value, trainable=False))
        self._step = _make_train_step(
            model, self.update_started, self.generation, list(zip(self._shadows, self._guarded))
        )

    def __call__(self, data: Any) -> Dict[str, Any]:
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

    def _settle(self) -> StepOutcome:
        generation = int(self.generation.numpy())
        if generation == self._completed:
            return StepOutcome.UNTOUCHED
        self._completed = generation
        for shadow, v in zip(self._shadows, self._guarded):
            v.assign(shadow)
        if int(self.update_started.numpy()):
            return StepOutcome.UPDATE_BEGAN
        return StepOutcome.RESTORED


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
        return flagged_train_step(model, data, update_started)

    return _compile(model, train_step)


def flagged_train_step(model: keras.Model, data: Any, update_started: tf.Variable) -> Any:
    """Keras's default train step on `data`, `update_started` set to 1 just before the update.

    Forward pass and loss, gradients, then `update_started.assign(1)` once
    every gradient is computed and before `apply_gradients` (so a failed
    step tells whether the optimizer update began), the loss tracker, the
    metrics. Traced inside a step (on one device, or per replica).
    """
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
    _track_loss(model, loss, x)
    return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


class CustomTrainStep:
    """A model's own (overridden) `train_step`, compiled as Keras would.

    It cannot tell how far a failed call got, nor snapshot what it touches:
    callers snapshot the small state with a `Guard` around each call.

    Attributes:
        snapshots_itself: False.
        last_outcome: Always None (unknown).
    """

    snapshots_itself = False
    last_outcome: Optional[StepOutcome] = None

    def __init__(self, model: keras.Model) -> None:
        model_ref = weakref.ref(model)

        def train_step(data):
            return model_ref().train_step(data)

        self._step = _compile(model, train_step)

    def __call__(self, data: Any) -> Dict[str, Any]:
        return self._step(data)


def make_custom_train_step(model: keras.Model) -> CustomTrainStep:
    """A `CustomTrainStep` running `model.train_step`."""
    return CustomTrainStep(model)


def add_gradients(
    model: keras.Model, data: Any, weight: Any, sums: Sequence[Any], *, densify: bool
) -> Tuple[bool, ...]:
    """One micro-batch of Keras's default train step, its gradients added to `sums`.

    Forward pass and loss; the gradients of the loss scaled by `weight` (the
    micro-batch's share of the batch) added to `sums` (sparse gradients
    scattered in, or `densify`d first for sums that cannot scatter); the
    loss tracker and metrics updated. Traced inside a step (on one device,
    or per replica).

    Returns:
        For each trainable weight, whether it got no gradient.
    """
    x, y, sample_weight = _unpack(data)
    with tf.GradientTape() as tape:
        y_pred, loss = _forward_loss(model, x, y, sample_weight)
        scaled = model.optimizer.scale_loss(loss) * tf.cast(weight, loss.dtype)
    gradients = tape.gradient(scaled, model.trainable_weights)
    for total, g in zip(sums, gradients):
        if g is None:
            continue
        if isinstance(g, tf.IndexedSlices) and not densify:
            total.scatter_add(g)
        else:
            total.assign_add(tf.convert_to_tensor(g))
    _track_loss(model, loss, x)
    model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
    return tuple(g is None for g in gradients)


def apply_sums(model: keras.Model, sums: Sequence[Any], mask: Sequence[bool]) -> None:
    """One optimizer step with the summed gradients (`mask`: weights that got none)."""
    pairs = [
        (total.read_value(), w)
        for total, w, missing in zip(sums, model.trainable_weights, mask)
        if not missing
    ]
    model.optimizer.apply_gradients(pairs)


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
            traced["mask"] = add_gradients(model_ref(), data, weight, sums, densify=False)

        def apply_step(mask):
            apply_sums(model_ref(), sums, mask)

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
    """A `GradientAccumulator` over `model`'s trainable weights."""
    return GradientAccumulator(model)
