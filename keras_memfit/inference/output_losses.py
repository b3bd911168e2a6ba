"""Counting a batch split after an OOM as the one batch it is, for per-output losses.

Its pieces run the exact step; after the last, each tracker is rescaled to (batch mean, weight 1).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, List, Optional, Sequence, Tuple

import keras

from keras_memfit import backend as _backend
from keras_memfit._internal import batches as _batches
from keras_memfit._internal import keras_compat as _keras_compat
from keras_memfit._internal import reductions as _reductions

Copies = Callable[[Any], Sequence[Any]]


class CountedOnce:
    """Settles a split batch's per-output loss trackers, on each of `copies`, to one batch's count.

    `begin()` before its first piece (after any failed try was undone), `settle()` after its last.
    """

    def __init__(
        self, model: keras.Model, exact: bool = False, copies: Optional[Copies] = None
    ) -> None:
        """`exact`: means over samples (nothing to settle); `copies(v)`: what pieces update."""
        counts_once = (
            not exact
            and _backend.get().KERAS_COUNTS_EACH_BATCH_ONCE
            and not getattr(model, "run_eagerly", False)
        )
        self.trackers = _keras_compat.per_output_loss_trackers(model) if counts_once else []
        copies = copies or (lambda variable: (variable,))
        self._copies = [  # (total, count) of each copy of each tracker
            pair for t in self.trackers for pair in zip(copies(t.total), copies(t.count))
        ]
        self.before: Optional[List[Tuple[Any, Any]]] = None

    def begin(self) -> None:
        """Note the trackers' state before a split batch."""
        if self.trackers:
            self.before = [(_value(total), _value(count)) for total, count in self._copies]

    def settle(self) -> None:
        """Count what the pieces added since `begin()` as one batch."""
        if self.before is None:
            return
        for (total_now, count_now), (total, count) in zip(self._copies, self.before):
            added = _value(count_now) - count
            if added > 0:
                total_now.assign(total + (_value(total_now) - total) / added)
                count_now.assign(count + 1)
        self.before = None


class SplitLoss:
    """Settles a split batch's total loss for "sum" and "mean_with_sample_weight" reductions."""

    def __init__(self, model: keras.Model, how: str, copies: Copies) -> None:
        tracker = _keras_compat.loss_tracker(model)
        self.model = model
        self.how = how
        self._copies = list(zip(copies(tracker.total), copies(tracker.count)))
        self.before: Optional[List[Tuple[Any, Any]]] = None

    def _read(self) -> List[Tuple[Any, Any]]:
        return [(_value(total), _value(count)) for total, count in self._copies]

    def begin(self) -> None:
        _backend.get().materialize(self.model)  # on JAX, inside Keras's loop: the variables
        self.before = self._last = self._read()
        self._sums = [[0.0, 0.0] for _ in self._copies]  # (sum of weight x loss, of weights)

    def piece(self, data: Any) -> None:
        now = self._read()
        sample_weights = _reductions.sample_weight_sum(data)
        for (total, count), (total0, count0), sums in zip(now, self._last, self._sums):
            rows = count - count0
            if rows > 0:
                weight = rows if sample_weights is None else sample_weights
                weight = 1.0 if self.how == _reductions.ONE else weight
                sums[0] += weight * (total - total0) / rows
                sums[1] += weight
        self._last = now

    def settle(self) -> None:
        for (total, count), (total0, count0), (weighted, weights) in zip(
                self._copies, self.before, self._sums):
            rows = _value(count) - count0
            if rows > 0 and weights:
                loss = weighted if self.how == _reductions.ONE else weighted / weights
                total.assign(total0 + rows * loss)
        self.before = None


class SplitBatches:
    """Tracks the batch being run, and settles the per-output losses of a split one.

    Per Keras batch `begin_batch(rows)` (or `tag(chunks)`) and `step(...)`; `finished(piece)`.
    """

    def __init__(self, model: keras.Model, exact: bool, copies: Optional[Copies] = None) -> None:
        self.model = model
        self.counted = CountedOnce(model, exact, copies)
        how = _reductions.weighting(model)[0]
        self.loss = None
        if how in (_reductions.ONE, _reductions.SAMPLE_WEIGHTS):
            self.loss = SplitLoss(model, how, copies or (lambda variable: (variable,)))
        self.rows = 0
        self.done = 0
        self.split = False  # whether the current batch runs as pieces

    def begin_batch(self, rows: int) -> None:
        """A batch of `rows` (one of Keras's) begins."""
        self.rows, self.done, self.split = rows, 0, False
        self.counted.before = None

    def tag(self, chunks: Iterable[Any], batch_size: Optional[int]) -> Iterator[Any]:
        """Keras's batches, each begun (arrays cut at `batch_size` where losses are settled)."""
        for chunk in chunks:
            n = _batches.num_rows(chunk)
            step = batch_size if (self.counted.trackers or self.loss) and batch_size else n
            for start in range(0, n, step or 1):
                batch = _batches.rows(chunk, start, start + step)
                self.begin_batch(_batches.num_rows(batch))
                yield batch

    def step(
        self, keras_step: Callable[[Any], Any], make_exact: Callable[[Any], Callable]
    ) -> Callable[[Any], Any]:
        """`keras_step` for whole batches, the exact step (`make_exact`, once) for a split one's."""
        if not self.counted.trackers and self.loss is None:
            return keras_step
        exact_step = None

        def run(piece: Any) -> Any:
            nonlocal exact_step
            if _batches.num_rows(piece) >= self.rows:
                return keras_step(piece)
            if not self.split:  # the state before the batch (a failed try was undone)
                self.split = True
                self.counted.begin()
                if self.loss is not None:
                    self.loss.begin()
            if not self.counted.trackers:
                return keras_step(piece)
            if exact_step is None:
                exact_step = make_exact(piece)
            return exact_step(piece)

        return run

    def finished(self, piece: Any) -> bool:
        """Note a successful piece; True when it ended a split batch (now settled)."""
        self.done += piece.rows
        if not self.split:
            return False
        if self.loss is not None:
            self.loss.piece(piece.data)
        if self.done < self.rows:
            return False
        self.counted.settle()
        if self.loss is not None:
            self.loss.settle()
        self.split = False
        return True


def _value(variable: Any) -> Any:
    return keras.ops.convert_to_numpy(variable)
