"""Gradient accumulation on TensorFlow: micro-batch gradients summed, applied as one step."""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import keras
import tensorflow as tf

from keras_memfit._internal.model_state import train_state_variables
from keras_memfit._internal.units import format_bytes
from keras_memfit.backend.tensorflow.compiling import compile_step, needs_static_batch
from keras_memfit.backend.tensorflow.default_step import forward_loss, track_loss
from keras_memfit.backend.tensorflow.xla_holds import XlaHolds


def add_gradients(
    model: keras.Model, data: Any, weight: Any, loss_factor: Any,
    add: Callable[[int, Any], None],
) -> Tuple[bool, ...]:
    """One micro-batch of Keras's default train step: `add(i, gradient of loss * weight)`.

    Returns:
        For each trainable weight, whether it got no gradient.
    """
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    with tf.GradientTape() as tape:
        y_pred, loss = forward_loss(model, x, y, sample_weight)
        scaled = model.optimizer.scale_loss(loss) * tf.cast(weight, loss.dtype)
    gradients = tape.gradient(scaled, model.trainable_weights)
    for i, g in enumerate(gradients):
        if g is not None:
            add(i, g)
    track_loss(model, loss * tf.cast(loss_factor, loss.dtype), x)
    model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
    return tuple(g is None for g in gradients)


def zero(sums: Sequence[Any]) -> None:
    """Set each sum made so far (not None) to zero."""
    for total in sums:
        if total is not None:
            total.assign(tf.zeros_like(total))


def apply_gradients(model: keras.Model, gradients: Sequence[Any]) -> None:
    """One optimizer step with `gradients` (one per trainable weight; None: it got none)."""
    model.optimizer.apply_gradients(
        [(g, w) for g, w in zip(gradients, model.trainable_weights) if g is not None]
    )


def sparse_gradients(model: keras.Model, data: Any) -> Tuple[bool, ...]:
    """For each trainable weight, whether its traced gradient on `data` is a `tf.IndexedSlices`."""
    found: List[Tuple[bool, ...]] = []

    def probe(data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            _, loss = forward_loss(model, x, y, sample_weight)
        gradients = tape.gradient(loss, model.trainable_weights)
        found.append(tuple(isinstance(g, tf.IndexedSlices) for g in gradients))
        return loss

    if getattr(model, "run_eagerly", False):
        probe(data)
    else:
        tf.function(probe).get_concrete_function(data)
    return found[-1]


def sums_sparse_exactly(optimizer: Any) -> bool:
    """Whether `optimizer` updates a sparse gradient as its rows' sum (SGD without clipping)."""
    clipped = any(
        getattr(optimizer, name, None) for name in ("clipnorm", "clipvalue", "global_clipnorm")
    )
    return type(optimizer) is keras.optimizers.SGD and not clipped


def kept_rows_text(optimizer: Any, kept: Sequence[Tuple[Sequence[Any], Any]]) -> Optional[str]:
    """The sparse gradients' rows an update holds, in words; None when there are none.

    Args:
        kept: Per weight, its pieces' rows (`tf.IndexedSlices.values`) and the weight.
    """
    if not kept:
        return None
    texts = []
    for values, weight in kept:
        rows = sum(int(v.shape[0]) for v in values)
        row_bytes = values[0].shape[1:].num_elements() * values[0].dtype.size
        texts.append(f"{rows} rows of '{weight.path}' ({format_bytes(rows * row_bytes)})")
    return (f"{', '.join(texts)}: the sparse gradients' rows, one per lookup, all kept "
            f"because {type(optimizer).__name__} updates them row by row")


def _zeros_like(weight: Any) -> tf.Variable:
    """A sum of zeros on `weight`'s device, of no static shape."""
    with tf.device(weight.device):
        return tf.Variable(tf.zeros_like(weight), shape=tf.TensorShape(None), trainable=False)


class AccumulationSteps:
    """A model's compiled accumulation steps and their sums (no static shape), kept across fits.

    Attributes:
        sums: Per trainable weight, its dense sum, or None (a sparse gradient, or not made yet).
        sparse_sums: Per index of a weight whose sparse gradient is summed densely, that sum.
    """

    def __init__(self, model: keras.Model) -> None:
        model_ref = weakref.ref(model)
        weights = list(model.trainable_weights)
        self.weights = weights
        self.sums: List[Optional[tf.Variable]] = []
        self.sparse_sums: Dict[int, tf.Variable] = {}
        self.sums_sparse = sums_sparse_exactly(model.optimizer)
        self.sparse: Optional[Tuple[bool, ...]] = None  # per weight, known at the first batch
        self.in_use = False
        traced = {"mask": tuple(False for _ in weights), "sparse": ()}
        self.traced = traced
        sums = self.sums

        def add_step(data, weight, loss_factor):
            sparse = {}

            def add(i, g):
                if sums[i] is None and isinstance(g, tf.IndexedSlices):
                    sparse[i] = g
                else:
                    sums[i].assign_add(tf.convert_to_tensor(g))

            traced["mask"] = add_gradients(model_ref(), data, weight, loss_factor, add)
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
            for i, slices in zip(traced["sparse"], sparse):  # None: summed densely
                gradients[i] = slices if slices is not None else tf.ensure_shape(
                    self.sparse_sums[i].read_value(), weights[i].shape)
            apply_gradients(model_ref(), gradients)

        self.add = compile_step(model, add_step, static_shapes=needs_static_batch(model))
        self.apply = compile_step(model, apply_step)
        self.reset = tf.function(lambda: zero(sums))
        self.holds = XlaHolds(
            model, small=lambda: train_state_variables(model_ref()),
            large=lambda: [t for t in sums if t is not None],
        )

    def fill(self, model: keras.Model, data: Any) -> None:
        """Zero the dense sums, making those not made yet (after an OOM, the next fill)."""
        if self.sparse is None:
            self.sparse = sparse_gradients(model, data)
        for w, total in zip(self.weights, self.sums):
            if total is not None:
                total.assign(tf.zeros_like(w.value))
        made = len(self.sums)
        for w, sparse in zip(self.weights[made:], self.sparse[made:]):
            self.sums.append(None if sparse else _zeros_like(w.value))

    def sparse_sum(self, i: int) -> tf.Variable:
        """Weight `i`'s dense sum of sparse gradients, zeroed (made the first time)."""
        weight = self.weights[i].value
        total = self.sparse_sums.get(i)
        if total is None:
            total = self.sparse_sums[i] = _zeros_like(weight)
        else:
            total.assign(tf.zeros_like(weight))
        return total

    def free(self) -> None:
        """Empty the sums and end the use."""
        with tf.init_scope():  # eagerly, even if the accumulator is collected during a trace
            for total in [*self.sums, *self.sparse_sums.values()]:
                if total is not None:
                    total.assign(tf.zeros([0], total.dtype))
        self.in_use = False


class GradientAccumulator:
    """Sums weighted micro-batch gradients and applies them once, as Keras's step would.

    A sparse gradient's slices are kept and concatenated, unless `sums_sparse_exactly`: then they
    go into a dense sum once they have more rows than the weight.
    """

    def __init__(self, model: keras.Model, steps: AccumulationSteps) -> None:
        self._model = weakref.ref(model)
        self.steps = steps
        self._filled = False
        self._kept: List[List[tf.IndexedSlices]] = []  # per sparse gradient, each piece's slices
        self._summed: Set[int] = set()  # the sparse gradients summed densely in this batch
        self._held: Optional[str] = None  # the rows the last `apply` held, in words
        weakref.finalize(self, self.steps.free).atexit = False  # not while TF shuts down

    def reset(self) -> None:
        """Start a new batch."""
        self._kept = []
        self._summed = set()
        if self._filled:
            self.steps.reset()

    def add(self, data: Any, weight: float, loss_factor: float) -> None:
        steps = self.steps
        if not self._filled:
            steps.fill(self._model(), data)
            self._filled = True
        with steps.holds.holding(data):  # the weights are cast to the loss dtype inside
            slices = steps.add(
                data, tf.constant(weight, tf.float64), tf.constant(loss_factor, tf.float64))
        self._keep(slices)

    def _keep(self, slices: Sequence[tf.IndexedSlices]) -> None:
        """Keep a micro-batch's sparse slices, or add them to their weight's dense sum."""
        steps = self.steps
        if not self._kept:
            self._kept = [[] for _ in slices]
        for j, (i, new) in enumerate(zip(steps.traced["sparse"], slices)):
            kept = self._kept[j]
            if i not in self._summed:
                kept.append(new)
                rows = sum(int(k.values.shape[0]) for k in kept)
                if not steps.sums_sparse or rows <= steps.weights[i].shape[0]:
                    continue
                self._summed.add(i)
                total = steps.sparse_sum(i)
                while kept:  # each piece's memory goes back once it is added
                    total.scatter_add(kept.pop(0))
            else:
                steps.sparse_sums[i].scatter_add(new)

    def apply(self) -> None:
        """Apply the summed gradients and the kept slices as one optimizer step."""
        kept, self._kept = self._kept, []
        steps = self.steps
        sparse = steps.traced["sparse"]
        self._held = None if steps.sums_sparse else kept_rows_text(  # SGD: at most the weights
            self._model().optimizer,
            [([k.values for k in pieces], steps.weights[i]) for i, pieces in zip(sparse, kept)])
        gradients: List[Optional[tf.IndexedSlices]] = []
        for j in range(len(sparse)):
            pieces, kept[j] = kept[j], []  # only their concatenation is needed now
            gradients.append(None if not pieces else tf.IndexedSlices(
                tf.concat([k.values for k in pieces], 0),
                tf.concat([k.indices for k in pieces], 0),
                pieces[0].dense_shape,
            ))
            del pieces
        del kept
        self._summed = set()
        steps.apply(steps.traced["mask"], tuple(gradients))

    def held(self) -> Optional[str]:
        return self._held

