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

`run_in_pieces` is a generator: it yields each successful piece (`Piece`:
its rows, its data, the step's result) in input order, and the caller reads
the run as one loop over it. Leaving that loop early (`break`, or an error in
its body) closes the generator, which undoes the pieces started ahead.

With `accumulation`, a chunk that does not fit in one piece is run all or
nothing instead (MemFit's gradient accumulation: the chunk is one training
batch, its pieces are micro-batches whose gradients make one update): see
`Accumulation`.

With `start` (a backend whose steps run asynchronously: JAX), up to `AHEAD`
pieces are started before the oldest of them is waited for, as Keras's own
loops overlap their steps. A started piece's new state is the model's at
once, so the next piece runs on it; when waiting shows that a piece ran out
of memory, its step put the state back, the pieces started after it are
dropped, and they all run again, one piece at a time from then on. The loop
yields the same pieces, in the same order, as without `start`.

`run_whole` is the loop's first try of one chunk, alone: MemFit runs each
Keras batch through it (once per training step, where the host's
microseconds count), and only a batch that the planner splits or that ran
out of memory (`SPLIT`) goes on to `run_in_pieces`, which carries on from
there as it would have after that try.
"""

from __future__ import annotations

import dataclasses
import gc
from typing import Any, Callable, Dict, Hashable, Iterable, Iterator, List, Optional, Tuple

from keras_memfit.backend.base import Guard, StartedPiece
from keras_memfit.oom import (
    CANNOT_SPLIT, ONE_SAMPLE, OutOfMemoryError, can_place, is_retryable_oom,
)
from keras_memfit.planning import data as _data
from keras_memfit.planning.planner import BatchPlanner, Event


@dataclasses.dataclass(frozen=True)
class Piece:
    """A piece `run_in_pieces` ran successfully.

    Attributes:
        rows: Its number of rows.
        data: The piece itself (a chunk structure, see `keras_memfit.planning.data`).
        result: What the step returned for it (for a chunk run by
            `Accumulation`, `finish()`'s result).
        parts: The steps it ran as: 1, or the micro-batches of a chunk run
            by `Accumulation`.
    """

    rows: int
    data: Any
    result: Any
    parts: int = 1


@dataclasses.dataclass(frozen=True)
class Accumulation:
    """How `run_in_pieces` runs a chunk that does not fit in one piece: all or nothing.

    When the size planned for a chunk's first piece is smaller than the
    chunk, the chunk is run as: `begin()`, `guard.snapshot()`, then
    `add(piece)` for consecutive pieces, then
    `finish()`, whose result is the chunk's. When a piece runs out of memory,
    `guard.restore()` undoes the attempt, the planner chooses a smaller size
    and the chunk starts over; any other exception from a piece (a
    `KeyboardInterrupt` too) also restores the guard, then propagates. An
    error from `begin()` or `finish()` propagates as it is. The chunk is
    yielded once, as one `Piece` of `parts` micro-batches.

    It is passed in rather than yielded piece by piece because the loop
    itself must start the whole chunk over after an OOM in any of its
    micro-batches (restore, shrink, `begin()` again): a caller reading
    micro-batches from the loop would have to repeat that retry.

    Attributes:
        begin: Starts an attempt (zeroes the gradient sums).
        add: Runs one piece (its gradients added to the chunk's).
        finish: Completes the chunk (applies the summed gradients).
        guard: The state the pieces update (metrics, counters), restored
            after a failed attempt.
    """

    begin: Callable[[], None]
    add: Callable[[Any], None]
    finish: Callable[[], Any]
    guard: Guard


def run_in_pieces(
    model: Any,
    phase: str,
    chunks: Iterable[Any],
    step: Callable[[Any], Any],
    *,
    requested: Optional[int],
    guard: Optional[Guard] = None,
    events: Optional[List[Event]] = None,
    planner: Optional[BatchPlanner] = None,
    accumulation: Optional[Accumulation] = None,
    detail: str = "",
    start: Optional[Callable[[Any], StartedPiece]] = None,
) -> Iterator[Piece]:
    """Run `step` over every chunk in adaptive pieces, yielding each successful one.

    Args:
        model: The model (key for the planner's memory).
        phase: "predict", "evaluate" or "train".
        chunks: Iterable of chunk structures (see `keras_memfit.planning.data`).
        step: Runs one piece; its first leaf of `x` decides the signature.
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
        start: Starts `step` on a piece without waiting (a backend's
            `StartableStep.start`; its `StartedPiece` puts back the state of
            a failed step itself). Given, up to `AHEAD` pieces are started
            before the oldest is waited for, as Keras's loops overlap their
            steps; the pieces are still yielded one by one, in order.
            After the first OOM, and while the planner measures memory,
            pieces run one at a time with `step`.

    Yields:
        Each successful `Piece`, in input order; every row is in exactly
        one. A chunk run by `accumulation` is one piece. To stop early, leave
        the loop: the pieces started ahead are undone.

    Raises:
        OutOfMemoryError: If a piece of a single sample runs out of memory,
            or any piece of a model with stateful layers (cause "cannot_split").

    Example:
        >>> for piece in run_in_pieces(model, "predict", chunks, step, requested=32):
        ...     outputs.append(piece.result)
    """
    run = _PieceLoop(model, phase, step, guard, detail, start)
    planners: Dict[Hashable, BatchPlanner] = {}
    try:
        for chunk in chunks:
            current = planner
            if current is None:
                sig = _data.signature(chunk[0])
                current = planners.get(sig)
                if current is None:
                    current = planners[sig] = BatchPlanner(model, phase, sig, requested, events)
            yield from run.rows(chunk, current, accumulation)
        yield from run.wait_all()
    finally:
        run.drop()


SPLIT = object()
"""What `run_whole` returns when the chunk is not run whole: run it with `run_in_pieces`."""


def run_whole(
    model: Any,
    phase: str,
    chunk: Any,
    step: Callable[[Any], Any],
    planner: BatchPlanner,
    *,
    guard: Optional[Guard] = None,
    detail: str = "",
    rows: Optional[int] = None,
) -> Any:
    """`chunk` as one piece, as `run_in_pieces` runs it first, where the planner's size covers it.

    What `run_in_pieces(model, phase, [chunk], step, ..., planner=planner,
    guard=guard, detail=detail)` does (and yields) while the planner's next
    size is at least the chunk's rows, without its loop: for MemFit's
    batches, which run whole (once per Keras step) unless memory is short.
    `rows`: the chunk's rows, where the caller knows them.

    Returns:
        `step`'s result, or `SPLIT` when the planner's size is smaller than
        the chunk or the chunk ran out of memory (the guard restored, the
        planner told: it chose a smaller size). Then `run_in_pieces` with the
        same planner runs the chunk, on from that size, as it would have
        after that first try.

    Raises:
        OutOfMemoryError: If the chunk is a single sample and ran out of memory.

    Example:
        >>> logs = run_whole(model, "train", chunk, step, planner)
        >>> if logs is SPLIT:
        ...     for piece in run_in_pieces(model, "train", [chunk], step, requested=None,
        ...                                planner=planner):
        ...         logs = piece.result
    """
    n = _data.num_rows(chunk) if rows is None else rows
    if not n:
        return SPLIT  # no rows: no step, as in `run_in_pieces`
    planned = planner.next_size(n)
    if planned < n:
        return SPLIT
    return _attempt(model, phase, step, chunk, n, planned, planner, guard, detail)


def _attempt(model: Any, phase: str, step: Callable[[Any], Any], piece: Any, size: int,
             planned: float, planner: BatchPlanner, guard: Optional[Guard], detail: str) -> Any:
    """One try of `step` on `piece` (`size` rows of a planned `planned`): its result, or `SPLIT`.

    `SPLIT` after an OOM that can be retried smaller: the guard restored and
    the planner told (it shrank). Raises `OutOfMemoryError` when the piece
    was a single sample, and any other error as it is.
    """
    planner.started(size)
    if guard is not None:
        guard.snapshot()
    try:
        result = step(piece)
    except Exception as exc:
        if not is_retryable_oom(exc):
            raise  # not an OOM, or one already judged final
        if guard is not None:
            guard.restore()
        if not planner.failed(size):
            raise _final_error(model, phase, piece, planner, detail) from exc
        drop_frames(exc)
        return SPLIT
    planner.succeeded(size, full=size >= planned)
    return result


# At most this many pieces are left started and not waited for (starting one
# more waits for the oldest; Keras's own loops never wait). Each holds its
# outputs until it is waited for. Measured on a small MLP at batch 32 on 2 CPU
# cores, safe_predict against model.predict: 1 ahead 1.13x, 2 ahead 0.95x,
# 4 ahead 0.91x (benchmarks/RESULTS.md, overhead-jax notes).
AHEAD = 2


@dataclasses.dataclass
class _Ahead:
    """A piece started and not waited for yet."""

    planner: BatchPlanner
    piece: Any
    size: int
    planned: float
    started: StartedPiece


class _PieceLoop:
    """One `run_in_pieces` call: its pieces, retries, and the pieces started ahead.

    Its methods are generators of the successful pieces, in order.
    """

    def __init__(self, model: Any, phase: str, step: Callable[[Any], Any],
                 guard: Optional[Guard], detail: str,
                 start: Optional[Callable[[Any], StartedPiece]]) -> None:
        self.model, self.phase, self.detail = model, phase, detail
        self.step, self.guard, self.start = step, guard, start
        self.ahead: List[_Ahead] = []  # started, not waited for yet, oldest first

    def failed(self, planner: BatchPlanner, piece: Any, size: int, exc: BaseException) -> None:
        """After an OOM of `piece`: shrink, or raise if a single sample did not fit."""
        if not planner.failed(size):
            raise _final_error(self.model, self.phase, piece, planner, self.detail) from exc

    def rows(self, chunk: Any, planner: BatchPlanner,
             accumulation: Optional[Accumulation] = None) -> Iterator[Piece]:
        """Run all of `chunk`'s rows in pieces, in order, yielding the successful ones.

        With `accumulation`, a chunk whose first piece would be smaller than
        the chunk (also after its first try ran out of memory) runs all or
        nothing instead, as one piece.
        """
        n = _data.num_rows(chunk)
        offset = 0
        while offset < n:
            planned = planner.next_size(n - offset)
            if accumulation is not None and offset == 0 and planned < n:
                yield from self.wait_all()
                result, parts = _all_or_nothing(
                    self.model, self.phase, chunk, planner, accumulation, self.detail
                )
                yield Piece(n, chunk, result, parts)
                return
            size = int(min(planned, n - offset))
            piece = _data.rows(chunk, offset, offset + size)
            if self.start is not None and not planner.measuring:
                started = yield from self._start(planner, piece, size, planned)
                if started:  # else it did not start (an OOM): try smaller
                    offset += size
                continue
            yield from self.wait_all()
            result = _attempt(self.model, self.phase, self.step, piece, size, planned, planner,
                              self.guard, self.detail)
            if result is SPLIT:
                continue  # it ran out of memory: the planner chose a smaller size
            offset += size
            yield Piece(size, piece, result)

    def _start(self, planner: BatchPlanner, piece: Any, size: int,
               planned: float) -> Iterator[Piece]:
        """Start `piece`; then, if more than `AHEAD` pieces are started, wait for the oldest.

        Yields the pieces waited for; returns whether `piece` started (False
        after an OOM at once: the planner shrank).
        """
        planner.started(size)
        try:
            started = self.start(piece)
        except Exception as exc:
            if not is_retryable_oom(exc):
                raise
            self.start = None  # one piece at a time from now on
            drop_frames(exc)  # before the earlier rows are handed on
            yield from self.wait_all()  # the earlier rows first
            self.failed(planner, piece, size, exc)
            return False
        self.ahead.append(_Ahead(planner, piece, size, planned, started))
        if len(self.ahead) > AHEAD:
            yield from self._wait_oldest()
        return True

    def wait_all(self) -> Iterator[Piece]:
        """Wait for every piece started ahead, in order, yielding them."""
        while self.ahead:
            yield from self._wait_oldest()

    def _wait_oldest(self) -> Iterator[Piece]:
        oldest = self.ahead.pop(0)
        try:
            result = oldest.started.wait()
        except BaseException as exc:  # a KeyboardInterrupt too
            # Its state is back; the pieces started after it (on its state) are dropped.
            newer, self.ahead = self.ahead, []
            if not is_retryable_oom(exc):
                raise
            self.start = None  # one piece at a time from now on
            self.failed(oldest.planner, oldest.piece, oldest.size, exc)
            drop_frames(exc)
            for again in [oldest] + newer:
                yield from self.rows(again.piece, again.planner)
            return
        oldest.planner.succeeded(oldest.size, full=oldest.size >= oldest.planned)
        yield Piece(oldest.size, oldest.piece, result)

    def drop(self) -> None:
        """Undo the pieces started ahead, if any (stopped early, or an error)."""
        newer, self.ahead = self.ahead, []
        if newer:
            newer[0].started.undo()  # the state from before all of them


def _all_or_nothing(
    model: Any,
    phase: str,
    chunk: Any,
    planner: BatchPlanner,
    accumulation: Accumulation,
    detail: str,
) -> Tuple[Any, int]:
    """Run `chunk` by `accumulation`, starting over smaller after an OOM.

    Returns:
        `finish()`'s result and the micro-batches of the attempt that succeeded.
    """
    n = _data.num_rows(chunk)
    guard = accumulation.guard
    while True:
        accumulation.begin()
        guard.snapshot()
        offset = size = parts = 0
        try:
            while offset < n:
                planned = planner.next_size(n - offset)
                size = int(min(planned, n - offset))
                piece = _data.rows(chunk, offset, offset + size)
                planner.started(size)
                accumulation.add(piece)
                planner.succeeded(size, full=size >= planned)
                offset += size
                parts += 1
        except Exception as exc:
            guard.restore()
            if not is_retryable_oom(exc):
                raise
            if not planner.failed(size):
                raise _final_error(model, phase, chunk, planner, detail) from exc
            drop_frames(exc)
            continue
        except BaseException:  # KeyboardInterrupt: leave the chunk undone
            guard.restore()
            raise
        return accumulation.finish(), parts


def drop_frames(exc: BaseException) -> None:
    """Free what a caught OOM holds before the retry: its traceback's frames hold the failed piece's buffers.

    The exception itself stays alive while it is handled (the retry runs
    inside its `except` block, or after it with the exception kept as the
    cause of a later error), so its frames, and those of the exceptions it
    was raised from, are cut from it rather than left to `del`.
    """
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        exc.__traceback__ = None
        exc = exc.__cause__ or exc.__context__
    gc.collect()


def _final_error(
    model: Any, phase: str, chunk: Any, planner: BatchPlanner, detail: str
) -> OutOfMemoryError:
    """The error for a single sample of `chunk` that does not fit (a stateful model: `chunk`)."""
    stateful = planner.stateful  # its batches are never split
    return OutOfMemoryError(
        getattr(model, "name", type(model).__name__),
        phase,
        _data.shapes(_data.rows(chunk[0], 0, 1)),
        planner.device,
        detail=detail,
        cause=CANNOT_SPLIT if stateful else ONE_SAMPLE,
        rows=_data.num_rows(chunk) if stateful else None,
        can_place=can_place(model),
        stateful=stateful,
    )
