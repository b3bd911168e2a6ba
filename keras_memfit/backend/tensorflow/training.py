"""Train steps that can tell how far a failed call got, and gradient accumulation.

MemFit's building blocks for the TensorFlow backend: `make_train_step` (Keras's
default step, with its small state snapshotted inside the same compiled call),
`make_custom_train_step` (a model's own `train_step`), `make_accumulator`
(micro-batch gradients summed and applied as one optimizer step), and the
checks `has_default_train_step`. Every returned
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
from keras_memfit.backend.tensorflow.steps import _compile, _needs_static_batch

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
        try:
            logs = step(data)
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


def add_gradients(
    model: keras.Model, data: Any, weight: Any, add: Callable[[int, Any], None]
) -> Tuple[bool, ...]:
    """One micro-batch of Keras's default train step, its gradients handed to `add`.

    Forward pass and loss; `add(i, gradient)` for each trainable weight `i`
    that got a gradient, the gradient of the loss scaled by `weight` (the
    micro-batch's share of the batch) as the tape gives it (a sparse one as a
    `tf.IndexedSlices`); the loss tracker and metrics updated. Traced inside a
    step (on one device, or per replica).

    Returns:
        For each trainable weight, whether it got no gradient.
    """
    x, y, sample_weight = _unpack(data)
    with tf.GradientTape() as tape:
        y_pred, loss = _forward_loss(model, x, y, sample_weight)
        scaled = model.optimizer.scale_loss(loss) * tf.cast(weight, loss.dtype)
    gradients = tape.gradient(scaled, model.trainable_weights)
    for i, g in enumerate(gradients):
        if g is not None:
            add(i, g)
    _track_loss(model, loss, x)
    model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
    return tuple(g is None for g in gradients)


def apply_gradients(model: keras.Model, gradients: Sequence[Any]) -> None:
    """One optimizer step with `gradients` (one per trainable weight; None: it got none)."""
    model.optimizer.apply_gradients(
        [(g, w) for g, w in zip(gradients, model.trainable_weights) if g is not None]
    )


def sparse_gradients(model: keras.Model, data: Any) -> Tuple[bool, ...]:
    """For each trainable weight, whether its gradient on `data` is a `tf.IndexedSlices`.

    Read from a symbolic trace of the forward and backward pass (nothing
    runs): which gradients are sparse is a property of the graph (an
    `Embedding` used only for its lookups), not of the batch size.
    """
    found: List[Tuple[bool, ...]] = []

    def probe(data):
        x, y, sample_weight = _unpack(data)
        with tf.GradientTape() as tape:
            _, loss = _forward_loss(model, x, y, sample_weight)
        gradients = tape.gradient(loss, model.trainable_weights)
        found.append(tuple(isinstance(g, tf.IndexedSlices) for g in gradients))
        return loss

    if getattr(model, "run_eagerly", False):
        probe(data)
    else:
        tf.function(probe).get_concrete_function(data)
    return found[-1]


class GradientAccumulator:
    """Sums weighted micro-batch gradients and applies them once, as Keras's step would.

    A dense gradient is added in place into a non-trainable variable the size
    of its weight (made at the first micro-batch, only once a batch has had
    to be split), so adding a micro-batch allocates
    nothing beyond its gradients. A sparse gradient (a `tf.IndexedSlices`,
    e.g. an `Embedding`'s: one row per token occurrence) is not summed: each
    micro-batch's scaled slices are kept, and `apply` hands the optimizer
    their concatenation, the slices of Keras's unsplit step (same rows, same
    order, duplicates kept). Summing them densely would change the update of
    an optimizer that treats the slices row by row (Adam squares each row
    into its velocity: `g1**2 + g2**2` for a token met twice, not
    `(g1 + g2)**2`). The kept slices are together the size of the whole
    batch's sparse gradient (what Keras's step holds), and no dense sum is
    made for those weights.
    """

    def __init__(self, model: keras.Model) -> None:
        model_ref = weakref.ref(model)
        weights = list(model.trainable_weights)
        self._weights = weights
        self._sums: List[Optional[tf.Variable]] = [None] * len(weights)
        # Known when the step is traced: which weights get no gradient, which sparse ones.
        traced = {"mask": tuple(False for _ in weights), "sparse": ()}
        self._traced = traced
        self._kept: List[Tuple[tf.IndexedSlices, ...]] = []  # each micro-batch's sparse slices
        sums = self._sums

        def add_step(data, weight):
            sparse = {}

            def add(i, g):
                if sums[i] is None and isinstance(g, tf.IndexedSlices):
                    sparse[i] = g
                else:
                    sums[i].assign_add(tf.convert_to_tensor(g))

            traced["mask"] = add_gradients(model_ref(), data, weight, add)
            traced["sparse"] = tuple(sorted(sparse))
            return tuple(
                tf.IndexedSlices(
                    g.values, g.indices,
                    tf.shape(weights[i].value) if g.dense_shape is None else g.dense_shape,
                )
                for i, g in sorted(sparse.items())
            )

        def apply_step(mask, sparse):
            gradients = [None if missing else s for missing, s in zip(mask, sums)]
            for i, slices in zip(traced["sparse"], sparse):
                gradients[i] = slices
            apply_gradients(
                model_ref(), [g.read_value() if isinstance(g, tf.Variable) else g for g in gradients]
            )

        self._add = _compile(model, add_step, static_shapes=_needs_static_batch(model))
        self._apply = _compile(model, apply_step)
        self._resets: Dict[int, Callable] = {}  # by how many sums exist
        self._model = model_ref
        self._made = False

    def reset(self) -> None:
        """Start a new batch: zero the sums, drop the kept slices."""
        self._kept = []
        made = [total for total in self._sums if total is not None]
        if not made:
            return
        reset = self._resets.get(len(made))
        if reset is None:

            @tf.function
            def reset():
                for total in made:
                    total.assign(tf.zeros_like(total))

            self._resets = {len(made): reset}
        reset()

    def _make_sums(self, data: Any) -> None:
        """The dense sums, made before the step is first traced (which captures them)."""
        for i, (w, sparse) in enumerate(zip(self._weights, sparse_gradients(self._model(), data))):
            if not sparse:
                with tf.device(w.value.device):
                    self._sums[i] = tf.Variable(tf.zeros_like(w.value), trainable=False)
        self._made = True

    def add(self, data: Any, weight: float) -> None:
        """Add `weight` times the gradient of the loss on micro-batch `data`."""
        if not self._made:
            self._make_sums(data)
        # the weight is cast to the loss dtype inside
        self._kept.append(self._add(data, tf.constant(weight, tf.float64)))

    def apply(self) -> None:
        """Apply the summed gradients (and the kept slices) as one optimizer step."""
        kept, self._kept = self._kept, []
        sparse = tuple(
            tf.IndexedSlices(
                tf.concat([k[j].values for k in kept], 0),
                tf.concat([k[j].indices for k in kept], 0),
                kept[0][j].dense_shape,
            )
            for j in range(len(self._traced["sparse"]))
        )
        del kept  # the pieces' slices: only their concatenation is needed now
        self._apply(self._traced["mask"], sparse)


def make_accumulator(model: keras.Model) -> GradientAccumulator:
    """A `GradientAccumulator` over `model`'s trainable weights."""
    return GradientAccumulator(model)
