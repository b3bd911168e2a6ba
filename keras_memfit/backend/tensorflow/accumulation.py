"""Gradient accumulation on TensorFlow: micro-batch gradients summed, applied as one step.

MemFit's accumulation for the TensorFlow backend: `add_gradients` (one
micro-batch of Keras's default step, its gradients handed on),
`apply_gradients`, `sparse_gradients` (which gradients are
`tf.IndexedSlices`, from a symbolic trace) and `make_accumulator`, a
`GradientAccumulator` (the `Accumulator` protocol of
`keras_memfit.backend.base`) whose compiled steps and sums are the model's,
kept across fits.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, List, Optional, Sequence, Tuple

import keras
import tensorflow as tf

from keras_memfit._internal.cache import per_model
from keras_memfit._internal.model_state import train_state_variables
from keras_memfit.backend.tensorflow.steps import _compile, _needs_static_batch
from keras_memfit.backend.tensorflow.training import (
    _forward_loss,
    _track_loss,
    _unpack,
)
from keras_memfit.backend.tensorflow.holds import XlaHolds


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


class AccumulationSteps:
    """A model's compiled accumulation steps and their sums, kept across fits.

    The sums are variables without a static shape, captured by the steps:
    between fits they hold an empty tensor (no memory), and the next fit
    fills them with zeros of the weights' shapes again, so its steps are the
    ones already traced and compiled (with `jit_compile`, each new step is an
    XLA compilation).

    Attributes:
        sums: Per trainable weight, its dense sum (a `tf.Variable` without a
            static shape, empty between fits), or None (a sparse gradient,
            or not made yet).
        in_use: Whether an accumulator runs on them now.
    """

    def __init__(self, model: keras.Model) -> None:
        model_ref = weakref.ref(model)
        weights = list(model.trainable_weights)
        self.weights = weights
        self.sums: List[Optional[tf.Variable]] = []
        self.sparse: Optional[Tuple[bool, ...]] = None  # per weight, known at the first batch
        self.in_use = False
        # Known when the step is traced: which weights get no gradient, which sparse ones.
        traced = {"mask": tuple(False for _ in weights), "sparse": ()}
        self.traced = traced
        sums = self.sums

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
            gradients: List[Any] = [
                None if missing or s is None else tf.ensure_shape(s.read_value(), w.shape)
                for missing, s, w in zip(mask, sums, weights)
            ]
            for i, slices in zip(traced["sparse"], sparse):
                gradients[i] = slices
            apply_gradients(model_ref(), gradients)

        def reset_step():
            for total in sums:
                if total is not None:
                    total.assign(tf.zeros_like(total))

        self.add = _compile(model, add_step, static_shapes=_needs_static_batch(model))
        self.apply = _compile(model, apply_step)
        self.reset = tf.function(reset_step)
        self.holds = XlaHolds(
            model, small=lambda: train_state_variables(model_ref()),
            large=lambda: [t for t in sums if t is not None],
        )

    def fill(self, model: keras.Model, data: Any) -> None:
        """Zeros of the weights' shapes in the dense sums (made, the first time, before any trace)."""
        if self.sparse is None:
            self.sparse = sparse_gradients(model, data)
            for w, sparse in zip(self.weights, self.sparse):
                if sparse:
                    self.sums.append(None)
                    continue
                with tf.device(w.value.device):
                    self.sums.append(tf.Variable(
                        tf.zeros_like(w.value), shape=tf.TensorShape(None), trainable=False))
            return
        for w, total in zip(self.weights, self.sums):
            if total is not None:
                total.assign(tf.zeros_like(w.value))

    def free(self) -> None:
        """Empty the sums (their memory, the weights' size, goes back) and end the use."""
        with tf.init_scope():  # eagerly, even if the accumulator is collected during a trace
            for total in self.sums:
                if total is not None:
                    total.assign(tf.zeros([0], total.dtype))
        self.in_use = False


def _accumulation_steps(model: keras.Model) -> AccumulationSteps:
    """The model's `AccumulationSteps`, cached per model (new weights or optimizer: new ones)."""
    key = (
        "accumulation steps",
        id(model.optimizer),
        tuple(id(v) for v in model.trainable_weights),
        bool(getattr(model, "run_eagerly", False)),
        model.jit_compile,
    )
    steps = per_model(model, key, lambda: AccumulationSteps(model))
    if steps.in_use:  # another accumulator of this model is alive: its own steps
        steps = AccumulationSteps(model)
    steps.in_use = True
    return steps


class GradientAccumulator:
    """Sums weighted micro-batch gradients and applies them once, as Keras's step would.

    A dense gradient is added in place into a non-trainable variable the size
    of its weight (filled at the first micro-batch, only once a batch has had
    to be split, and emptied when the accumulator is freed, at the end of
    `fit`), so adding a micro-batch allocates
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

    The compiled steps and the sum variables are the model's, kept across
    fits (`AccumulationSteps`): a second fit compiles nothing new. Under
    `jit_compile`, a micro-batch holds the small state's values while it
    runs, and the sums' on the first micro-batch of each size (`XlaHolds`),
    so an OOM inside XLA leaves them intact.

    Attributes:
        steps: The model's compiled steps and sums it runs on (kept across fits).
    """

    def __init__(self, model: keras.Model) -> None:
        self._model = weakref.ref(model)
        self.steps = _accumulation_steps(model)
        self._filled = False
        self._kept: List[Tuple[tf.IndexedSlices, ...]] = []  # each micro-batch's sparse slices
        weakref.finalize(self, self.steps.free).atexit = False  # not while TF shuts down

    def reset(self) -> None:
        """Start a new batch: zero the sums, drop the kept slices."""
        self._kept = []
        if self._filled:
            self.steps.reset()

    def add(self, data: Any, weight: float) -> None:
        """Add `weight` times the gradient of the loss on micro-batch `data`."""
        steps = self.steps
        if not self._filled:
            steps.fill(self._model(), data)
            self._filled = True
        signature, held = steps.holds.hold(data)
        try:  # the weight is cast to the loss dtype inside
            self._kept.append(steps.add(data, tf.constant(weight, tf.float64)))
        finally:
            held.clear()  # before a retry resets the sums
        steps.holds.ran(signature)

    def apply(self) -> None:
        """Apply the summed gradients (and the kept slices) as one optimizer step."""
        kept, self._kept = self._kept, []
        traced = self.steps.traced
        sparse = tuple(
            tf.IndexedSlices(
                tf.concat([k[j].values for k in kept], 0),
                tf.concat([k[j].indices for k in kept], 0),
                kept[0][j].dense_shape,
            )
            for j in range(len(traced["sparse"]))
        )
        del kept  # the pieces' slices: only their concatenation is needed now
        self.steps.apply(traced["mask"], sparse)


def make_accumulator(model: keras.Model) -> GradientAccumulator:
    """A `GradientAccumulator` over `model`'s trainable weights."""
    return GradientAccumulator(model)
