"""Running a compiled step over chunks in pieces, retrying smaller on OOM.

This is the one loop behind `safe_predict`, `safe_evaluate` and MemFit: for
every chunk, run the step on consecutive pieces of the size the planner
chooses; when a piece runs out of memory, undo what the failed step touched,
let the planner choose a smaller size and carry on from the same offset. A
`guard` (see `backend.guard_variables`) snapshots the state a step may touch
before every attempt and restores it after a failed one. So every sample is
in exactly one successful piece, in input order. Errors that are not OOMs
propagate untouched; a piece of one sample that runs out of memory raises
`OutOfMemoryError`.

With `accumulation`, a chunk that does not fit in one piece is run all or
nothing instead (MemFit's gradient accumulation: the chunk is one training
batch, its pieces are micro-batches whose gradients make one update): see
`Accumulation`.
"""

from __future__ import annotations

import dataclasses
import gc
from typing import Any, Callable, Dict, Hashable, Iterable, Iterator, List, Optional

from keras_memfit import data as _data
from keras_memfit.backend.base import Guard
from keras_memfit.oom import OutOfMemoryError, is_retryable_oom
from keras_memfit.planner import BatchPlanner, Event


@dataclasses.dataclass(frozen=True)
class Accumulation:
    """How `run_in_pieces` runs a chunk that does not fit in one piece: all or nothing.

    When the size planned for a chunk's first piece is smaller than the
    chunk, the chunk is run as: `begin()`, `guard.snapshot()`, then
    `add(piece, num_rows / chunk_rows)` for consecutive pieces, then
    `finish()`, whose result is the chunk's. When a piece runs out of memory,
    `guard.restore()` undoes the attempt, the planner chooses a smaller size
    and the chunk starts over; any other exception from a piece (a
    `KeyboardInterrupt` too) also restores the guard, then propagates. An
    error from `begin()` or `finish()` propagates as it is.

    Attributes:
        begin: Starts an attempt (zeroes the gradient sums).
        add: Runs one piece with its share of the chunk's rows.
        finish: Completes the chunk (applies the summed gradients).
        guard: The state the pieces update (metrics, counters), restored
            after a failed attempt.
    """

    begin: Callable[[], None]
    add: Callable[[Any, float], None]
    finish: Callable[[], Any]
    guard: Guard


class Pieces:
    """An `on_piece` for `run_in_pieces` that keeps the last result and counts pieces.

    Attributes:
        result: The last successful piece's result (None before any).
        count: Pieces so far (callers may reset or adjust it, e.g. per batch).
        ran: Whether any piece succeeded.

    Example:
        >>> pieces = Pieces()
        >>> run_in_pieces(model, "evaluate", chunks, step, pieces, requested=None)
        >>> logs = pieces.result
    """

    def __init__(self) -> None:
        self.result: Any = None
        self.count = 0
        self.ran = False

    def __call__(self, size: int, piece: Any, result: Any) -> bool:
        self.result = result
        self.count += 1
        self.ran = True
        return False


def run_in_pieces(
    model: Any,
    phase: str,
    chunks: Iterable[Any],
    step: Callable[[Any], Any],
    on_piece: Callable[[int, Any, Any], bool],
    *,
    requested: Optional[int],
    guard: Optional[Guard] = None,
    events: Optional[List[Event]] = None,
    planner: Optional[BatchPlanner] = None,
    accumulation: Optional[Accumulation] = None,
    detail: str = "",
) -> int:
    """Run `step` over every chunk in adaptive pieces.

    Args:
        model: The model (key for the planner's memory).
        phase: "predict", "evaluate" or "train".
        chunks: Iterable of chunk structures (see `keras_memfit.data`).
        step: Runs one piece; its first leaf of `x` decides the signature.
        on_piece: Called as `on_piece(num_rows, piece, result)` after each
            successful piece; returning True stops early. A chunk run by
            `accumulation` counts as one piece, whose result is `finish()`'s.
        requested: Largest piece size, or None to be bounded by the chunks.
        guard: Object with `snapshot()` and `restore()`, called before every
            attempt of `step` and after a failed one, for state it may touch.
        events: Receives one `Event` per adaptation.
        planner: A planner to use for every chunk instead of one per input
            signature (the caller keeps it across calls).
        accumulation: How to run a chunk that does not fit in one piece, all
            or nothing (see `Accumulation`); None: piece by piece with `step`.
        detail: Extra sentence for the `OutOfMemoryError` raised when a
            single sample does not fit.

    Returns:
        The number of samples processed.

    Raises:
        OutOfMemoryError: If a piece of a single sample runs out of memory.
    """
    planners: Dict[Hashable, BatchPlanner] = {}
    done = 0
    for chunk in chunks:
        n = _data.num_rows(chunk)
        sig = _data.signature(chunk[0])
        current = planner or planners.get(sig)
        if current is None:
            current = planners[sig] = BatchPlanner(model, phase, sig, requested, events)
        offset = 0
        while offset < n:
            planned = current.next_size()
            if accumulation is not None and offset == 0 and planned < n:
                result = _all_or_nothing(model, phase, chunk, current, accumulation, detail)
                offset = n
                done += n
                if on_piece(n, chunk, result):
                    return done
                break
            size = int(min(planned, n - offset))
            piece = _data.rows(chunk, offset, offset + size)
            current.started(size)
            if guard is not None:
                guard.snapshot()
            try:
                result = step(piece)
            except Exception as exc:
                if not is_retryable_oom(exc):
                    raise  # not an OOM, or one already judged final
                if guard is not None:
                    guard.restore()
                if not current.failed(size):
                    raise _final_error(model, phase, piece, current, detail) from exc
                del exc
                gc.collect()
                continue
            current.succeeded(size, full=size >= planned)
            offset += size
            done += size
            if on_piece(size, piece, result):
                return done
    return done


def _all_or_nothing(
    model: Any,
    phase: str,
    chunk: Any,
    planner: BatchPlanner,
    accumulation: Accumulation,
    detail: str,
) -> Any:
    """Run `chunk` by `accumulation`, starting over smaller after an OOM."""
    n = _data.num_rows(chunk)
    guard = accumulation.guard
    while True:
        accumulation.begin()
        guard.snapshot()
        offset = size = 0
        try:
            while offset < n:
                planned = planner.next_size()
                size = int(min(planned, n - offset))
                piece = _data.rows(chunk, offset, offset + size)
                planner.started(size)
                accumulation.add(piece, size / n)
                planner.succeeded(size, full=size >= planned)
                offset += size
        except Exception as exc:
            guard.restore()
            if not is_retryable_oom(exc):
                raise
            if not planner.failed(size):
                raise _final_error(model, phase, chunk, planner, detail) from exc
            del exc
            gc.collect()
            continue
        except BaseException:  # KeyboardInterrupt: leave the chunk undone
            guard.restore()
            raise
        return accumulation.finish()


def _final_error(
    model: Any, phase: str, chunk: Any, planner: BatchPlanner, detail: str
) -> OutOfMemoryError:
    """The error for a single sample of `chunk` that does not fit."""
    return OutOfMemoryError(
        getattr(model, "name", type(model).__name__),
        phase,
        _data.shapes(_data.rows(chunk[0], 0, 1)),
        planner.device,
        detail=detail,
    )


def prepend(first: Any, rest: Iterator[Any]) -> Iterator[Any]:
    """`first`, then the items of `rest`.

    Unlike `itertools.chain`, closing it (which dropping it does) closes
    `rest` too, so an input left unfinished (`steps`, an early stop) ends its
    epoch as soon as the run is over.
    """
    yield first
    yield from rest
