"""Counting a batch split after an OOM as the one batch it is, for per-output losses.

Keras's own `evaluate` on TensorFlow traces its test step on a dataset whose
batch dimension is unknown, so the per-output loss trackers of a
multi-output model (`"<output>_loss"`) count each batch's mean once,
whatever the batch's size: the result is the mean of the batch means, not
the mean over samples (the two differ when the last batch is shorter).
`safe_evaluate` runs its test step the same way (see the backend's
`make_test_step`), so a batch run whole counts exactly as in Keras.

MemFit's training (`mode="accumulate"`) counts a split batch once the same
way (`CountedOnce`), as Keras's train step counts each batch.

A batch split into pieces after an OOM must still count once. Its pieces run
the exact step (traced per piece size: each tracker weights a piece by its
rows, so the pieces add up to rows x the batch mean); when the batch's last
piece is done, each tracker's contribution is rescaled to the one Keras's
whole batch would have made: `(batch mean, weight 1)`. That costs two reads
of the trackers per split batch, and nothing for a batch run whole. The mean
loss of a batch is its pieces' means weighted by their rows, which holds for
Keras's default reduction ("sum_over_batch_size"), as the total `"loss"`
(always weighted by rows) already assumes.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, List, Optional, Sequence, Tuple

import keras

from keras_memfit import backend as _backend
from keras_memfit._internal import keras_compat as _keras_compat
from keras_memfit.planning import data as _data

Copies = Callable[[Any], Sequence[Any]]


class CountedOnce:
    """Settles a split batch's per-output loss trackers to the one count Keras gives a batch.

    Call `begin()` before the batch's first piece (after any failed try was
    undone) and `settle()` after its last: each tracker's contribution since
    `begin()` becomes `(the pieces' mean weighted by their counts, weight 1)`,
    on each of its `copies` (a strategy's replicas: Keras counts each
    replica's batch once).
    Nothing to do (no trackers) on a backend whose Keras weights batches by
    rows, or for a model run eagerly (static shapes: Keras weights by rows).
    """

    def __init__(
        self, model: keras.Model, exact: bool = False, copies: Optional[Copies] = None
    ) -> None:
        """Args:
            model: The compiled model being run.
            exact: Per-output losses are wanted as means over samples
                (`safe_evaluate(exact_output_losses=True)`): nothing to settle.
            copies: A variable's copies that pieces update separately, each
                one readable and assignable (default: the variable itself).
        """
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


class SplitBatches:
    """Tracks the batch being run, and settles the per-output losses of a split one.

    Use: `begin_batch(rows)` as each of Keras's batches starts (or run the
    chunks from `tag(chunks)`), run it with the step from `step(...)`, and
    call `finished(rows)` after each successful piece.
    """

    def __init__(self, model: keras.Model, exact: bool, copies: Optional[Copies] = None) -> None:
        """Args:
            model: The compiled model being evaluated.
            exact: Whether per-output losses are exact means over samples
                (nothing to settle then).
            copies: As `CountedOnce`'s.
        """
        self.model = model
        self.counted = CountedOnce(model, exact, copies)
        self.rows = 0
        self.done = 0

    @property
    def trackers(self) -> List[Any]:
        """The per-output loss trackers to settle ([] when there is nothing to settle)."""
        return self.counted.trackers

    def begin_batch(self, rows: int) -> None:
        """A batch of `rows` (one of Keras's) begins."""
        self.rows, self.done, self.counted.before = rows, 0, None

    def tag(self, chunks: Iterable[Any], batch_size: Optional[int]) -> Iterator[Any]:
        """The batches Keras would run, noting each one's rows as it starts.

        Args:
            chunks: The input's chunks.
            batch_size: For array input (a single chunk), Keras's batch size:
                when there are losses to settle, the chunk is yielded as
                batches of it, so that no piece spans two of Keras's batches.
        """
        for chunk in chunks:
            n = _data.num_rows(chunk)
            step = batch_size if self.trackers and batch_size else n
            for start in range(0, n, step or 1):
                batch = _data.rows(chunk, start, start + step)
                self.begin_batch(_data.num_rows(batch))
                yield batch

    def step(
        self, keras_step: Callable[[Any], Any], make_exact: Callable[[Any], Callable]
    ) -> Callable[[Any], Any]:
        """`keras_step` for whole batches; the exact step for pieces of a split one.

        Args:
            keras_step: The step traced as Keras traces its own.
            make_exact: Returns the exact step (traced per piece size), given
                a piece; called once, at the first split.
        """
        if not self.trackers:
            return keras_step
        exact_step = None

        def run(piece: Any) -> Any:
            nonlocal exact_step
            if _data.num_rows(piece) >= self.rows:
                return keras_step(piece)
            if self.counted.before is None:  # the state before the batch (a failed try was undone)
                self.counted.begin()
            if exact_step is None:
                exact_step = make_exact(piece)
            return exact_step(piece)

        return run

    def finished(self, rows: int) -> bool:
        """Note a successful piece of `rows`; True when it ended a split batch (now settled)."""
        self.done += rows
        if self.counted.before is None or self.done < self.rows:
            return False
        self.counted.settle()
        return True


def _value(variable: Any) -> Any:
    return keras.ops.convert_to_numpy(variable)
