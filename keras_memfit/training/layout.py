"""How a Keras batch is laid out for MemFit: what its pieces are, and what runs them.

`OneDevice`: a batch is its rows, a piece a run of consecutive rows (`Rows`). `Replicated`
(`tf.distribute` MirroredStrategy, OneDeviceStrategy): one replica's OOM aborts the whole
step, so every replica runs the same number of pieces, as *slots* (`Slots`): a batch whose
largest replica holds `m` rows is `m` slots, and slots `a:b` are, on a replica of `n` rows,
its rows `a*n//m : b*n//m`; the planner sizes the largest replica's rows. Every step a
layout makes takes the Keras batch of a piece (`Cut.batch`).
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Iterable, List, Optional, Protocol, Tuple, Union

import keras
import numpy as np

from keras_memfit import backend as _backend
from keras_memfit._internal import batches as _batches
from keras_memfit._internal import cache as _cache
from keras_memfit._internal import reductions as _reductions
from keras_memfit._internal.batches import (
    as_batch, as_chunk, concatenate, first_unsplittable, form_of, splittable_rows,
)
from keras_memfit.backend.base import Accumulator, Guard, TrainStep
from keras_memfit.inference.output_losses import CountedOnce, SplitBatches
from keras_memfit.inference.steps import predict_step, test_step_and_guard


class Cut(Protocol):
    """One Keras batch as a layout cuts it.

    `chunk` is what `run_in_pieces` cuts, its rows the batch's slots (`slots`, what the
    planner sizes); `rows`: the batch's rows on every device; `signature`: the planner's key;
    `x`: one device's inputs (for MemFit's warnings).
    """

    chunk: tuple
    slots: int
    rows: int
    signature: Hashable
    x: Any

    def batch(self, piece: tuple) -> Any:
        """The Keras batch of `piece`'s rows, as the layout's steps take it."""

    def micro_batch(self, piece: tuple, how: str) -> Tuple[Any, Any, Any]:
        """`piece`'s batch, weight and loss factor for `Accumulator.add` (`how`: a weighting)."""

    def rows_in(self, piece: tuple) -> int:
        """The rows `piece` runs, on every device."""

    def join(self, outputs: List[Any]) -> Any:
        """The predict step's outputs on consecutive pieces, as one, in the input's order."""


class Rows:
    """A batch on one device: its rows; a piece is a run of them (see `Cut`)."""

    __slots__ = ("chunk", "form", "slots", "rows", "signature", "x")

    def __init__(self, chunk: tuple, form: int, rows: int) -> None:
        self.chunk = chunk
        self.form = form  # how Keras packed the batch: every piece alike
        self.slots = self.rows = rows
        self.x = chunk[0]
        self.signature = _batches.signature(chunk[0])

    def batch(self, piece: tuple) -> Any:
        return as_batch(piece, self.form)

    def micro_batch(self, piece: tuple, how: str) -> Tuple[Any, Any, Any]:
        return (as_batch(piece, self.form), *_reductions.weights(how, piece, self.chunk))

    def rows_in(self, piece: tuple) -> int:
        return _batches.num_rows(piece)

    def join(self, outputs: List[Any]) -> Any:
        return concatenate(outputs)


class OneDevice:
    """The identity layout: a batch is its rows, run by the backend's own steps."""

    key: Hashable = "one device"

    def cut(self, batch: Any) -> Optional[Rows]:
        """`batch` as `Rows`, or None when it cannot be split (see `unsplittable`)."""
        chunk = as_chunk(batch)
        n = splittable_rows(chunk)
        return None if n is None else Rows(chunk, form_of(batch), n)

    def unsplittable(self, batches: Iterable[Any]) -> Optional[str]:
        """What cannot be split in `batches`, in words (see `batches.unsplittable`)."""
        return first_unsplittable(as_chunk(batch) for batch in batches)

    def prepare(self, model: keras.Model, cut: Rows) -> None:
        """Build the model, its metrics and loss (and optimizer) before a train step is made."""
        _backend.get().prepare_test(model, _batches.rows(cut.chunk, 0, 1))

    def train_step(self, model: keras.Model, custom: bool, cut: Rows) -> TrainStep:
        """The train step (the model's own `train_step` when `custom`, built on `cut`'s batch)."""
        backend = _backend.get()
        if custom:  # built as Keras builds it: by the step itself, on Keras's batch
            return backend.make_custom_train_step(model, cut.batch(cut.chunk))
        return backend.make_train_step(model)

    def guard(self, variables: List[Any]) -> Guard:
        return _backend.get().guard_variables(variables)

    def accumulator(self, model: keras.Model) -> Accumulator:
        """A gradient accumulator (sums the size of the weights)."""
        return _backend.get().make_accumulator(model)

    def counted(self, model: keras.Model) -> CountedOnce:
        """What counts an accumulated batch once for the per-output losses, as Keras's step does."""
        return CountedOnce(model)

    def test_parts(
        self, model: keras.Model, cut: Rows
    ) -> Tuple[Callable[[Any], Any], Guard, SplitBatches]:
        """The test step (traced as `evaluate` traces Keras's), a guard over the metric state,
        and what counts a split batch once for the per-output losses."""
        step, guard = test_step_and_guard(model, cut.chunk, exact=False)
        return step, guard, SplitBatches(model, False)

    def exact_test_step(self, model: keras.Model, cut: Rows) -> Callable[[Any], Any]:
        """The test step whose per-output loss trackers weight a piece by its rows."""
        return test_step_and_guard(model, cut.chunk, exact=True)[0]

    def predict_step(self, model: keras.Model) -> Callable[[Any], Any]:
        """The predict step on a Keras batch (its inputs)."""
        step = predict_step(model)
        return lambda batch: step(as_chunk(batch)[0])


class Slots:
    """A distributed batch as slots (`local`: each replica's rows as chunks; see `Cut`)."""

    def __init__(self, replicas: Any, batch: Any, local: List[tuple], counts: List[int]) -> None:
        self.replicas = replicas
        self.distributed = batch
        self.form = form_of(batch)  # how Keras packed it: each replica's pieces alike
        self.local = local
        self.counts = counts
        self.slots = max(counts)
        self.rows = sum(counts)
        largest = local[counts.index(self.slots)]
        self.x = largest[0]
        # The chunk run_in_pieces splits: x with the largest replica's shapes
        # (stride-0 views, for the OutOfMemoryError's message), y the slots.
        shapes = keras.tree.map_structure(
            lambda leaf: None if leaf is None
            else np.broadcast_to(np.zeros((), np.bool_), (self.slots,) + tuple(leaf.shape[1:])),
            largest[0],
        )
        self.chunk = (shapes, np.arange(self.slots), None)
        self.signature = (_batches.signature(largest[0]), "replicas", replicas.count)

    def _parts(self, piece: tuple) -> List[tuple]:
        """Each replica's rows for the slots of `piece`."""
        slots = piece[1]
        a, b = (int(slots[0]), int(slots[-1]) + 1) if len(slots) else (0, 0)
        return [
            _batches.rows(chunk, a * n // self.slots, b * n // self.slots)
            for chunk, n in zip(self.local, self.counts)
        ]

    def batch(self, piece: tuple) -> Any:
        if len(piece[1]) == self.slots:
            return self.distributed  # the whole batch, as Keras distributed it
        return self.replicas.distribute([as_batch(c, self.form) for c in self._parts(piece)])

    def micro_batch(self, piece: tuple, how: str) -> Tuple[Any, Any, Any]:
        chunks = self._parts(piece)  # each replica weighted in its own rows
        weights, factors = zip(*(
            _reductions.weights(how, part, whole) for part, whole in zip(chunks, self.local)))
        return (self.replicas.distribute([as_batch(c, self.form) for c in chunks]),
                self.replicas.scalars(weights), self.replicas.scalars(factors))

    def rows_in(self, piece: tuple) -> int:
        return sum(_batches.num_rows(chunk) for chunk in self._parts(piece))

    def join(self, outputs: List[Any]) -> Any:
        """Each replica's pieces in order, then the replicas in order, as Keras joins them."""
        return concatenate([
            concatenate([per_replica[r] for per_replica in outputs])
            for r in range(self.replicas.count)
        ])


class Replicated:
    """The replicas of a `tf.distribute` strategy, each batch split alike on all of them."""

    def __init__(self, replicas: Any) -> None:
        self.replicas = replicas
        self.key: Hashable = ("replicas", id(replicas.strategy))

    def cut(self, batch: Any) -> Optional[Slots]:
        """`batch` as `Slots`, or None when some replica's rows cannot be split."""
        local = self.replicas.local(batch)
        counts = [splittable_rows(chunk) for chunk in local]
        return None if None in counts else Slots(self.replicas, batch, local, counts)

    def unsplittable(self, batches: Iterable[Any]) -> Optional[str]:
        """What cannot be split in some replica's rows of `batches`, in words."""
        return first_unsplittable(
            chunk for batch in batches for chunk in self.replicas.local(batch))

    def prepare(self, model: keras.Model, cut: Slots) -> None:
        """Build the model, its metrics and loss, under the strategy's scope."""
        with self.replicas.strategy.scope():
            _backend.get().prepare_test(model, _batches.rows(cut.local[0], 0, 1))

    def train_step(self, model: keras.Model, custom: bool, cut: Slots) -> TrainStep:
        """The train step on a distributed batch (`model.train_step` when `custom`)."""
        return self.replicas.train_step(model, custom)

    def guard(self, variables: List[Any]) -> Guard:
        """A guard over every replica's copy of `variables`."""
        return self.replicas.guard(variables)

    def accumulator(self, model: keras.Model) -> Accumulator:
        """A gradient accumulator over the replicas (one all-reduce when applied)."""
        return self.replicas.accumulator(model)

    def counted(self, model: keras.Model) -> CountedOnce:
        """What counts an accumulated batch once for each replica's per-output losses."""
        return CountedOnce(model, copies=self.replicas.copies)

    def test_parts(
        self, model: keras.Model, cut: Slots
    ) -> Tuple[Callable[[Any], Any], Guard, SplitBatches]:
        """Keras's test step on a distributed batch, a guard over the metric state (cached), and
        what counts a split batch once for each replica's per-output losses."""
        self.prepare(model, cut)
        step, guard = _cache.per_model(
            model, self._test_key(model, "evaluate"),
            lambda: (self.replicas.test_step(model), self.replicas.guard(model.metrics_variables)),
        )
        return step, guard, SplitBatches(model, False, self.replicas.copies)

    def exact_test_step(self, model: keras.Model, cut: Slots) -> Callable[[Any], Any]:
        """The test step whose per-output loss trackers weight a piece by its rows, cached."""
        return _cache.per_model(model, self._test_key(model, "exact evaluate"),
                                lambda: self.replicas.test_step(model, exact=True))

    def _test_key(self, model: keras.Model, kind: str) -> Hashable:
        return (kind, self.key, tuple(id(v) for v in model.metrics_variables),
                bool(getattr(model, "run_eagerly", False)), model.jit_compile)

    def predict_step(self, model: keras.Model) -> Callable[[Any], List[Any]]:
        """`model.predict_step` on a distributed batch: each replica's outputs, cached."""
        key = ("predict", self.key, bool(getattr(model, "run_eagerly", False)), model.jit_compile)
        return _cache.per_model(model, key, lambda: self.replicas.predict_step(model))


Layout = Union[OneDevice, Replicated]


def layout_of(model: keras.Model) -> Layout:
    """The layout of `model`'s batches: `Replicated` under a strategy's replicas, else `OneDevice`.

    Raises:
        NotImplementedError: For a distribution MemFit cannot train under.
    """
    replicas = _backend.get().training_replicas(model)
    return OneDevice() if replicas is None else Replicated(replicas)
