"""Train steps that can tell how far a failed call got, and gradient accumulation.

MemFit's building blocks for the TensorFlow backend: `make_train_step` (Keras's
default step, with its small state snapshotted inside the same compiled call),
`make_custom_train_step` (a model's own `train_step`), the check
`has_default_train_step`, and `held_values`/`XlaHolds` (what an XLA call
that updates variables holds so that an OOM leaves them intact); gradient accumulation is
in `accumulation.py`. Every returned
object satisfies its protocol in `keras_memfit.backend.base`.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import keras
import numpy as np
import tensorflow as tf

from keras_memfit._internal import keras_compat as _keras_compat
from keras_memfit._internal.model_state import train_state_variables
from keras_memfit.backend.base import StepOutcome
from keras_memfit.backend.tensorflow.steps import _compile

logger = logging.getLogger("keras_memfit")


def _tensorflow_train_step() -> Any:
    """Keras's own `train_step` for the TensorFlow backend (`TensorFlowTrainer.train_step`)."""
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    return TensorFlowTrainer.train_step


def _unscale_loss_for_distribution(loss: Any) -> Any:
    """The loss without the distribution strategy's scaling (as Keras's train step).

    Keras 3.8 began scaling the loss by the number of replicas (and added
    this function); before it the loss was never scaled, so it is returned
    as it is.
    """
    from keras.src.losses import loss as loss_module

    unscale = getattr(loss_module, "unscale_loss_for_distribution", None)
    return loss if unscale is None else unscale(loss)


def has_default_train_step(model: keras.Model) -> bool:
    """Whether `model` uses Keras's own `train_step` (no override)."""
    return getattr(type(model).train_step, "__code__", None) is getattr(
        _tensorflow_train_step(), "__code__", object()
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
        _unscale_loss_for_distribution(loss), sample_weight=_rows(x)
    )


# The strict order is used where it costs at most this share of the estimated
# peak of the step (see `TrainStep`).
STRICT_SHARE = 0.02


class TrainStep:
    """Keras's default train step, compiled, that can tell how far a failed step got.

    Same computation as `TensorFlowTrainer.train_step`, plus, inside the same
    compiled function (no extra call per step):

    - a snapshot of `guarded` (the small state a step updates: see
      `train_state_variables`) into shadow variables, then a bump of
      `generation`; the forward pass depends on both, so nothing that needs
      memory runs before them;
    - `update_began`, set to the step's generation before any op of the
      optimizer update may run (`flagged_train_step`), in one of two orders:

      - **strict**: once every gradient exists. Any OOM of the forward or
        backward pass then leaves weights and slots untouched (retriable),
        at the cost of every gradient alive at once: up to the gradients'
        bytes minus the largest one's more at the peak;
      - **free**: once the gradient computed first exists (the last
        trainable weight's, next to the loss); the update of a weight then
        runs, and frees its gradient, while earlier layers' gradients are
        still being computed, as in Keras's own step. An OOM after it began
        is not retriable.

    A call runs strict when that costs little: when the gradients' bytes
    minus the largest one's are at most `STRICT_SHARE` of the estimated
    training peak at its rows (`use_peak_estimate`; where activations
    dominate, OOMs come from the batch and strict keeps them retriable),
    when no estimate was given or it failed, and always after an OOM that
    left the weights untouched (the batch drives memory: later OOMs must stay
    retriable). Each order is a `tf.function`, traced when first used.

    When a call raises an `Exception`, the step reads the counters (host
    reads, only then), restores the small state if the snapshot had run, and
    sets `last_outcome` to a `StepOutcome`: `UNTOUCHED` (nothing ran: XLA,
    for one, allocates before it executes anything), `RESTORED` (it ran
    part-way; its small state is back), or `UPDATE_BEGAN` (the optimizer
    update had begun: weights and slots may be partly updated, so the step
    must not be retried).

    Attributes:
        snapshots_itself: True: callers need no `Guard` around a call.
        last_outcome: The outcome of the last call that raised, or None.
        strict_extra_bytes: What the strict order holds at most beyond the
            free one: the trainable weights' bytes minus the largest one's.
        always_strict: Whether every call runs strict (set after an OOM that
            left the weights untouched).
    """

    snapshots_itself = True

    def __init__(self, model: keras.Model, guarded: Sequence[Any]) -> None:
        self.update_began = tf.Variable(0, dtype=tf.int64, trainable=False)
        self.generation = tf.Variable(0, dtype=tf.int64, trainable=False)
        self._completed = 0  # generations the host knows have run
        self.last_outcome: Optional[StepOutcome] = None
        self.always_strict = False
        sizes = [_nbytes(w) for w in model.trainable_weights]
        self.strict_extra_bytes = sum(sizes) - max(sizes, default=0)
        self._peak_at: Optional[Callable[[int], Optional[int]]] = None
        self._guarded = list(guarded)
        self._shadows = []
        for v in self._guarded:
            with tf.device(v.value.device):
                self._shadows.append(tf.Variable(v.value, trainable=False))
        self._model = weakref.ref(model)
        self._steps: Dict[bool, Callable] = {}  # strict -> compiled step, made on first use
        # Under XLA a call holds what it updates (`XlaHolds`): an OOM then leaves it intact.
        self._holds = XlaHolds(
            model,
            small=lambda: self._guarded + self._shadows + [self.generation, self.update_began],
            large=lambda: _updated_by_a_step(self._model()),
        )

    def use_peak_estimate(self, peak_at: Callable[[int], Optional[int]]) -> None:
        """Choose the order of each call from `peak_at(rows)`: the estimated peak, or None."""
        self._peak_at = peak_at

    def strict_at(self, rows: Optional[int]) -> bool:
        """Whether a call on `rows` rows runs in the strict order (see the class docstring)."""
        if self.always_strict or self._peak_at is None or rows is None:
            return True
        try:
            peak = self._peak_at(rows)
        except Exception as exc:  # the estimate is advisory: strict is today's order
            logger.debug("MemFit: no peak estimate (%s); the train step runs strict", exc)
            peak = None
        if peak is None:
            self._peak_at = None
            return True
        return self.strict_extra_bytes <= STRICT_SHARE * peak

    def __call__(self, data: Any) -> Dict[str, Any]:
        strict = self.strict_at(_host_rows(data))
        step = self._steps.get(strict)
        if step is None:
            step = self._steps[strict] = _make_train_step(
                self._model(), self.update_began, self.generation,
                list(zip(self._shadows, self._guarded)), strict,
            )
        signature, held = self._holds.hold((strict, data))
        try:
            logs = step(data)
        except Exception:
            held.clear()  # the values go before the state is read or restored
            self.last_outcome = self._settle()
            raise
        except BaseException:  # KeyboardInterrupt: whatever ran, ran
            self._completed = int(self.generation.numpy())
            raise
        held.clear()
        self._holds.ran(signature)
        self._completed += 1
        return logs

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


def make_train_step(model: keras.Model) -> TrainStep:
    """A `TrainStep` for `model`, guarding `train_state_variables(model)`."""
    return TrainStep(model, train_state_variables(model))


def _make_train_step(
    model: keras.Model, update_began, generation, pairs, strict: bool
) -> Callable:
    model_ref = weakref.ref(model)

    def train_step(data):
        model = model_ref()
        reads = [shadow.assign(v.value) for shadow, v in pairs]
        with tf.control_dependencies(reads):
            bumped = generation.assign_add(1)
        with tf.control_dependencies([bumped]):
            data = keras.tree.map_structure(
                lambda t: None if t is None else tf.identity(t), data
            )
        return flagged_train_step(
            model, data, lambda: update_began.assign(generation.read_value()), strict=strict
        )

    return _compile(model, train_step)


def _tensors(gradient: Any) -> List[Any]:
    """The dense tensors of a gradient (a `tf.IndexedSlices`'s values and indices)."""
    if isinstance(gradient, tf.IndexedSlices):
        return [gradient.values, gradient.indices]
    return [gradient]


def flagged_train_step(
    model: keras.Model, data: Any, flag: Callable[[], Any], *, strict: bool = True
) -> Any:
    """Keras's default train step on `data`, `flag()` run before the optimizer update.

    Forward pass and loss, gradients, then `flag()` (an op that records that
    the update began, e.g. a variable's assign) and `apply_gradients` with
    every op of it depending on that op, so a failed step tells whether the
    update began; then the loss tracker and the metrics. `strict`: the flag
    waits for every gradient; else for the one of the last trainable weight
    (the first computed, next to the loss), so that the update of a weight
    may run while other gradients are still computed (see `TrainStep`).
    Gradients reach the optimizer as they are (sparse ones stay
    `tf.IndexedSlices`). Traced inside a step (on one device, or per replica).
    """
    x, y, sample_weight = _unpack(data)
    with tf.GradientTape() as tape:
        y_pred, loss = _forward_loss(model, x, y, sample_weight)
        scaled = model.optimizer.scale_loss(loss) if model.optimizer is not None else loss
    weights = model.trainable_weights
    if weights:
        gradients = tape.gradient(scaled, weights)
        present = [g for g in gradients if g is not None]
        waited = present if strict else present[-1:]
        with tf.control_dependencies([t for g in waited for t in _tensors(g)]):
            began = flag()
        with tf.control_dependencies([began]):
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



def held_values(variables: Sequence[Any]) -> List[Any]:
    """The current values of `variables`, to hold while an XLA call that updates them runs.

    TensorFlow's XLA launch donates the buffer of a resource variable the
    compiled function updates when nothing else references it, and when the
    call then fails (an OOM while XLA allocates, before anything runs) the
    donated buffer is freed while the variable still holds it: the variable
    reads freed memory, and its next assignment frees the buffer again
    (`bfc_allocator.cc: Check failed: c->in_use()` aborts the process).
    Holding a reference to each value while the call runs keeps it from
    being donated: XLA writes the updates into new buffers (the updated
    variables' bytes more during the call), and a failed call leaves the
    variables as they were.
    """
    values = []
    for v in variables:
        inner = v if isinstance(v, tf.Variable) else getattr(v, "value", None)
        if isinstance(inner, tf.Variable):
            values.append(inner.read_value())
    return values


def _updated_by_a_step(model: keras.Model) -> List[Any]:
    """The weights and optimizer variables a train step updates."""
    optimizer = getattr(model, "optimizer", None)
    return list(model.variables) + (list(optimizer.variables) if optimizer is not None else [])


def _signature(data: Any) -> Tuple[Any, ...]:
    """What an XLA program is compiled for: the shapes and dtypes of `data`'s tensors."""
    return tuple(
        (tuple(item.shape), str(getattr(item, "dtype", "")))
        if getattr(item, "shape", None) is not None else repr(item)
        for item in keras.tree.flatten(data)
    )


class XlaHolds:
    """What a compiled step that updates variables holds on each call under XLA.

    See `held_values`: a held variable survives an OOM of the call, at the
    cost of its bytes more during the call. The small state (`small()`:
    metrics, counters, snapshots) is held on every call. The large state
    (`large()`: weights, optimizer slots, gradient sums) only on the first
    call at each input signature: an XLA program allocates the same buffers
    at every call, so once one succeeded its next calls fit as well (unless
    the free memory shrank meanwhile), and the steady state donates them as
    Keras's own step does. Without `jit_compile` nothing is held (TensorFlow
    updates in place, and an OOM frees nothing it should not).

    Attributes:
        active: Whether the model's steps run under XLA.
    """

    def __init__(
        self, model: keras.Model, small: Callable[[], Sequence[Any]],
        large: Callable[[], Sequence[Any]],
    ) -> None:
        self.active = bool(model.jit_compile) and not getattr(model, "run_eagerly", False)
        self._small, self._large = small, large
        self._ran: set = set()

    def hold(self, data: Any) -> Tuple[Optional[Tuple[Any, ...]], List[Any]]:
        """The signature of a call on `data` and the values to hold while it runs."""
        if not self.active:
            return None, []
        signature = _signature(data)
        variables = list(self._small())
        if signature not in self._ran:
            variables += list(self._large())
        return signature, held_values(variables)

    def ran(self, signature: Optional[Tuple[Any, ...]]) -> None:
        """Record that a call at `signature` succeeded."""
        if signature is not None:
            self._ran.add(signature)
