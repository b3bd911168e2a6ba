"""MemFit's work on a batch split across replicas (`tf.distribute.MirroredStrategy`).

Under a strategy each Keras batch arrives already split: every replica holds
its own rows on its own device, the step runs on all replicas at once, and
the optimizer all-reduces their gradients into one update. One replica that
runs out of memory aborts the whole step, so a batch is split *per replica*:
piece `i` runs on every replica at once, each replica taking its own part of
its own rows, and every replica runs the same number of pieces (the
all-reduce must line up).

The pieces go through the one retry loop (`runner.run_in_pieces`) as
"slots": a batch whose largest replica holds `m` rows is a chunk of `m`
slots, and slots `a:b` are, on a replica holding `n` rows, its rows
`a*n//m : b*n//m` (all of them for the largest replica, proportionally for a
smaller one: the last batch can divide unevenly). So the planner plans the
rows of the largest replica, and the split is agreed before any replica runs
it; the sizes in MemFit's events are rows per replica (the largest
replica's). The guarantees are MemFit's on one device
(`keras_memfit.training.run`):

- the whole batch first, as Keras runs it (the distributed batch untouched);
- `mode="accumulate"`: micro-batch gradients, each replica's weighted by its
  share of that replica's rows, summed per replica and applied once (one
  all-reduce, one optimizer step): the same update as Keras's step on the
  whole batch, whose loss on each replica is the mean of its rows;
- `mode="shrink"`: one optimizer step per piece;
- validation and `evaluate` split the same way, metric state guarded;
  `predict` outputs reassembled in the input's order;
- a failed attempt leaves no trace: every replica's copy of the small state
  is snapshotted before it and restored after it; an OOM once the optimizer
  update began is final.

The backend's `training_replicas(model)` gives the `Replicas` object used here (see
`keras_memfit.backend.tensorflow.distribute`).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Hashable, List, Optional, Protocol, Tuple

import keras
import numpy as np

from keras_memfit import backend as _backend
from keras_memfit._internal import cache as _cache
from keras_memfit._internal import model_state as _model_state
from keras_memfit._internal.batches import as_batch, concatenate, first_unsplittable, form_of
from keras_memfit.backend.base import StepOutcome
from keras_memfit.oom import UPDATE, UPDATE_BEGAN, OutOfMemoryError, is_oom_error
from keras_memfit.planning import data as _data
from keras_memfit.planning.runner import Accumulation, Pieces, run_in_pieces


def replicas_of(model: keras.Model) -> Optional[Any]:
    """The backend's `Replicas` for the strategy `model` runs under, or None.

    Raises:
        NotImplementedError: For a strategy MemFit cannot split for.
    """
    return _backend.get().training_replicas(model)


class _Batch:
    """One distributed Keras batch: its replicas' chunks and the slots that index them."""

    def __init__(self, replicas: Any, batch: Any) -> None:
        self.replicas = replicas
        self.batch = batch
        self.form = form_of(batch)  # how Keras packed it: each replica's pieces alike
        self.local = replicas.local(batch)
        self.counts = [_data.num_rows(chunk) for chunk in self.local]
        self.slots = max(self.counts)
        largest = self.local[self.counts.index(self.slots)]
        # The chunk run_in_pieces splits: x with the largest replica's shapes
        # (stride-0 views, for the OutOfMemoryError's message), y the slots.
        shapes = keras.tree.map_structure(
            lambda leaf: None if leaf is None
            else np.broadcast_to(np.zeros((), np.bool_), (self.slots,) + tuple(leaf.shape[1:])),
            largest[0],
        )
        self.chunk = (shapes, np.arange(self.slots), None)
        self.signature = (_data.signature(largest[0]), "replicas", replicas.count)

    @property
    def rows(self) -> int:
        return sum(self.counts)

    def parts(self, piece: tuple) -> Tuple[List[tuple], List[float]]:
        """Each replica's rows for the slots of `piece`, and their share of its rows."""
        slots = piece[1]
        a, b = (int(slots[0]), int(slots[-1]) + 1) if len(slots) else (0, 0)
        chunks, shares = [], []
        for chunk, n in zip(self.local, self.counts):
            lo, hi = a * n // self.slots, b * n // self.slots
            chunks.append(_data.rows(chunk, lo, hi))
            shares.append((hi - lo) / n if n else 0.0)
        return chunks, shares

    def distributed(self, piece: tuple) -> Any:
        """The distributed Keras batch of `piece`'s rows (the batch itself when whole)."""
        if len(piece[1]) == self.slots:
            return self.batch
        chunks, _ = self.parts(piece)
        return self.replicas.distribute([as_batch(c, self.form) for c in chunks])


class RunView(Protocol):
    """What `ReplicaRun` uses of its `Run` (`keras_memfit.training.run`)."""

    model: keras.Model
    mode: str
    epoch_split: int

    def planner_for(self, phase: str, signature: Hashable, rows: int) -> Any: ...

    def note_pieces(self, phase: str, pieces: int, rows: int) -> None: ...

    def note_events(self, batch_rows: Optional[int]) -> None: ...

    def keras_call(self, kind: str, batches: List[Any], reason: Optional[str]) -> Any: ...


class ReplicaRun:
    """What `Run` (`keras_memfit.training.run`) does with each batch under a strategy.

    Args:
        run: The `Run` (its planners, events, mode and Keras's own functions).
        replicas: The backend's `Replicas`.
    """

    def __init__(self, run: RunView, replicas: Any) -> None:
        self.run = run
        self.replicas = replicas
        self._train: Optional[Dict[str, Any]] = None
        self._test: Optional[Tuple[Callable, Any]] = None
        self._predict: Optional[Callable] = None

    def _unsplittable(self, batches: List[Any]) -> Optional[str]:
        """What cannot be split in some replica's rows of `batches` (Keras's own step runs them)."""
        return first_unsplittable(
            chunk for batch in batches for chunk in self.replicas.local(batch)
        )

    # ---------------------------------------------------------------- train
    def train(self, batches: List[Any]) -> Any:
        """Train on each distributed Keras batch; returns the last one's logs."""
        reason = self._unsplittable(batches)
        if reason is not None:
            return self.run.keras_call("train", batches, reason)
        logs = None
        for batch in batches:
            logs = self._train_batch(_Batch(self.replicas, batch))
        return logs

    def release(self) -> None:
        """Free the gradient accumulator (its sums) at the end of a fit."""
        if self._train is not None:
            self._train["accumulator"] = None

    def _parts(self, batch: _Batch) -> Dict[str, Any]:
        if self._train is None:
            model, replicas = self.run.model, self.replicas
            backend = _backend.get()
            with replicas.strategy.scope():
                backend.prepare_test(model, _data.rows(batch.local[0], 0, 1))
            custom = not backend.has_default_train_step(model)
            key = (
                "replica-train", custom, id(replicas.strategy), id(model.optimizer),
                tuple(id(v) for v in model.trainable_variables),
                tuple(id(v) for v in model.metrics_variables),
                bool(getattr(model, "run_eagerly", False)), model.jit_compile,
            )
            self._train = _cache.per_model(
                model, key,
                lambda: {
                    "step": replicas.train_step(model, custom),
                    "guard": replicas.guard(_model_state.train_state_variables(model)),
                    "accumulator": None,
                },
            )
        return self._train

    def _train_batch(self, batch: _Batch) -> Any:
        run, model = self.run, self.run.model
        parts = self._parts(batch)
        planner = run.planner_for("train", batch.signature, batch.slots)
        pieces = Pieces()

        step = parts["step"]

        def run_step(piece: tuple) -> Any:
            try:
                return step(batch.distributed(piece))
            except Exception as exc:
                if is_oom_error(exc) and step.last_outcome is StepOutcome.UPDATE_BEGAN:
                    rows = sum(_data.num_rows(chunk) for chunk in batch.parts(piece)[0])
                    raise self._oom_error(batch, planner, UPDATE_BEGAN, rows) from exc
                raise

        accumulation = None
        if run.mode == "accumulate":
            accumulation = self._accumulation(parts, batch, planner, pieces)
        try:
            run_in_pieces(
                model, "train", [batch.chunk], run_step, pieces, requested=None,
                planner=planner, guard=parts["guard"], accumulation=accumulation,
            )
            planner.finish_batch()
            run.epoch_split = max(run.epoch_split, pieces.count)
            run.note_pieces("train", pieces.count, batch.rows)
        finally:
            run.note_events(batch.slots)
        return pieces.result

    def _accumulation(
        self, parts: Dict[str, Any], batch: _Batch, planner: Any, pieces: Pieces
    ) -> Accumulation:
        model, replicas = self.run.model, self.replicas

        def begin() -> None:
            if parts["accumulator"] is None:
                parts["accumulator"] = replicas.accumulator(model)
            parts["accumulator"].reset()
            pieces.count = -1  # on_piece counts the batch once more

        def add(piece: tuple, share: float) -> None:
            chunks, shares = batch.parts(piece)
            parts["accumulator"].add(
                replicas.distribute([as_batch(c, batch.form) for c in chunks]),
                replicas.scalars(shares),
            )
            pieces.count += 1

        def finish() -> Any:
            try:
                parts["accumulator"].apply()
            except Exception as exc:
                if not is_oom_error(exc):
                    raise
                raise self._oom_error(
                    batch, planner, UPDATE, batch.rows, parts["accumulator"].held()) from exc
            return model.get_metrics_result()

        return Accumulation(begin=begin, add=add, finish=finish, guard=parts["guard"])

    def _oom_error(
        self, batch: _Batch, planner: Any, cause: str, rows: int, held: Optional[str] = None
    ) -> OutOfMemoryError:
        """The error for an OOM once the optimizer update of `rows` of `batch` began (`cause`)."""
        return OutOfMemoryError(
            self.run.model.name, "train", _data.shapes(_data.rows(batch.chunk[0], 0, 1)),
            planner.device, cause=cause, rows=rows, held=held,
        )

    # ------------------------------------------------------------- evaluate
    def test(self, batches: List[Any]) -> Any:
        """Evaluate each distributed Keras batch; returns the last one's logs."""
        reason = self._unsplittable(batches)
        if reason is not None:
            return self.run.keras_call("test", batches, reason)
        run, model = self.run, self.run.model
        pieces = Pieces()

        for raw in batches:
            batch = _Batch(self.replicas, raw)
            if self._test is None:
                self._test = self._test_parts(batch)
            step, guard = self._test
            planner = run.planner_for("evaluate", batch.signature, batch.slots)
            pieces.count = 0
            try:
                run_in_pieces(
                    model, "evaluate", [batch.chunk],
                    lambda piece, batch=batch: step(batch.distributed(piece)),
                    pieces, requested=None, guard=guard, planner=planner,
                )
                planner.finish_batch()
                run.note_pieces("evaluate", pieces.count, batch.rows)
            finally:
                run.note_events(batch.slots)
        return pieces.result if pieces.ran else {}

    def _test_parts(self, batch: _Batch) -> Tuple[Callable, Any]:
        """The test step on a distributed batch and a guard over the metric state, cached."""
        model, replicas = self.run.model, self.replicas
        with replicas.strategy.scope():
            _backend.get().prepare_test(model, _data.rows(batch.local[0], 0, 1))
        key = (
            "replica-evaluate", id(replicas.strategy),
            tuple(id(v) for v in model.metrics_variables),
            bool(getattr(model, "run_eagerly", False)), model.jit_compile,
        )
        return _cache.per_model(
            model, key,
            lambda: (replicas.test_step(model), replicas.guard(model.metrics_variables)),
        )

    # -------------------------------------------------------------- predict
    def predict(self, batches: List[Any]) -> Any:
        """Predict each distributed Keras batch; outputs in the input's order.

        Keras concatenates the replicas' outputs in replica order; so does
        this, each replica's pieces first joined in order.
        """
        reason = self._unsplittable(batches)
        if reason is not None:
            return self.run.keras_call("predict", batches, reason)
        run, model = self.run, self.run.model
        if self._predict is None:
            key = ("replica-predict", id(self.replicas.strategy),
                   bool(getattr(model, "run_eagerly", False)), model.jit_compile)
            self._predict = _cache.per_model(
                model, key, lambda: self.replicas.predict_step(model)
            )
        step = self._predict
        outputs: List[Any] = []
        for raw in batches:
            batch = _Batch(self.replicas, raw)
            per_replica: List[List[Any]] = [[] for _ in range(self.replicas.count)]

            def on_piece(size: int, piece: Any, result: Any, per_replica=per_replica) -> bool:
                for part, out in zip(per_replica, result):
                    part.append(out)
                return False

            planner = run.planner_for("predict", batch.signature, batch.slots)
            try:
                run_in_pieces(
                    model, "predict", [batch.chunk],
                    lambda piece, batch=batch: step(batch.distributed(piece)),
                    on_piece, requested=None, planner=planner,
                )
                planner.finish_batch()
                run.note_pieces("predict", len(per_replica[0]), batch.rows)
            finally:
                run.note_events(batch.slots)
            outputs.extend(concatenate(part) for part in per_replica)
        return concatenate(outputs)
