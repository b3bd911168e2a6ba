"""Running a compiled step over chunks in pieces, retrying smaller on OOM.

The one loop behind `safe_predict`, `safe_evaluate` and MemFit: after an OOM the guard restores
what the step touched and the same rows run again smaller, so every sample is in exactly one
successful piece, in input order; other errors propagate untouched.
"""

from __future__ import annotations

import dataclasses
import gc
from typing import Any, Callable, Dict, Hashable, Iterable, Iterator, List, Optional

from keras_memfit._internal import batches as _batches
from keras_memfit.backend.base import Cut, Guard, StartedPiece, StepOutcome
from keras_memfit.oom import (
    CANNOT_SPLIT, ONE_SAMPLE, UPDATE_BEGAN, OutOfMemoryError, can_place, can_shrink,
    is_retryable_oom,
)
from keras_memfit.planning.planner import BatchPlanner, Event


@dataclasses.dataclass(frozen=True)
class Piece:
    """A piece `run_in_pieces` ran (`parts`: 1, or an `Accumulation`'s micro-batches)."""

    rows: int
    data: Any
    result: Any
    parts: int = 1


@dataclasses.dataclass(frozen=True)
class Accumulation:
    """How `run_in_pieces` runs a chunk that does not fit in one piece: all or nothing.

    `begin()` zeroes the sums, `add(piece)` adds a piece's gradients, `finish()` applies them
    (its result the chunk's); after an OOM `guard` is restored and the chunk starts over smaller.
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
    cut: Optional[Cut] = None,
) -> Iterator[Piece]:
    """Run `step` over every chunk in adaptive pieces, yielding each successful one in order.

    Args:
        requested: Largest piece size, or None to be bounded by the chunks.
        guard: `snapshot()` before every attempt of `step`, `restore()` after a failed one.
        planner: One planner for every chunk, instead of one per signature.
        accumulation: Runs a chunk that does not fit in one piece, all or nothing.
        detail: Extra sentence for the `OutOfMemoryError` of a single sample.
        start: Starts `step` without waiting: up to `AHEAD` pieces run ahead until an OOM.
        cut: The Keras batch the one chunk is (MemFit's): `step` runs on `cut.batch(piece)`.

    Raises:
        OutOfMemoryError: If a single sample, a stateful model's piece or a step whose update
            began runs out of memory.
    """
    run = _PieceLoop(model, phase, step, guard, detail, start, cut)
    planners: Dict[Hashable, BatchPlanner] = {}
    try:
        for chunk in chunks:
            current = planner
            if current is None:
                sig = _batches.signature(chunk[0])
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
    cut: Optional[Cut] = None,
) -> Any:
    """`chunk` as one piece, as `run_in_pieces` runs it first: `step`'s result, or `SPLIT`
    (too large for the planner, or an OOM) to go on with `run_in_pieces` and the same planner."""
    n = _batches.num_rows(chunk) if cut is None else cut.lanes
    if not n:
        return SPLIT  # no rows: no step, as in `run_in_pieces`
    planned = planner.next_size(n)
    if planned < n:
        return SPLIT
    return _attempt(model, phase, step, chunk, n, planned, planner, guard, "", cut)


def _attempt(model: Any, phase: str, step: Callable[[Any], Any], piece: Any, size: int,
             planned: float, planner: BatchPlanner, guard: Optional[Guard], detail: str,
             cut: Optional[Cut]) -> Any:
    """One try of `step` on `piece`: its result, or `SPLIT` after a retryable OOM."""
    planner.started(size)
    if guard is not None:
        guard.snapshot()
    try:
        result = step(piece if cut is None else cut.batch(piece))
    except Exception as exc:
        if not is_retryable_oom(exc):
            raise  # not an OOM, or one already judged final
        if getattr(step, "last_outcome", None) is StepOutcome.UPDATE_BEGAN:
            rows = _batches.num_rows(piece) if cut is None else cut.rows_in(piece)
            raise update_error(model, piece, planner.device, UPDATE_BEGAN, rows) from exc
        if guard is not None:
            guard.restore()
        _failed(model, phase, piece, planner, size, detail, exc)
        drop_frames(exc)
        return SPLIT
    planner.succeeded(size, full=size >= planned)
    return result


# At most this many pieces are left started and not waited for (RESULTS.md, overhead-jax).
AHEAD = 2


@dataclasses.dataclass
class _Ahead:

    planner: BatchPlanner
    piece: Any
    size: int
    planned: float
    started: StartedPiece


class _PieceLoop:
    """One `run_in_pieces` call; its methods are generators of the successful pieces, in order."""

    def __init__(self, model: Any, phase: str, step: Callable[[Any], Any],
                 guard: Optional[Guard], detail: str,
                 start: Optional[Callable[[Any], StartedPiece]], cut: Optional[Cut]) -> None:
        self.model, self.phase, self.detail = model, phase, detail
        self.step, self.guard, self.start, self.cut = step, guard, start, cut
        self.ahead: List[_Ahead] = []  # started, not waited for yet, oldest first

    def rows(self, chunk: Any, planner: BatchPlanner,
             accumulation: Optional[Accumulation] = None) -> Iterator[Piece]:
        """All of `chunk`'s rows in pieces, in order."""
        n = _batches.num_rows(chunk)
        offset = 0
        while offset < n:
            planned = planner.next_size(n - offset)
            if accumulation is not None and offset == 0 and planned < n:
                yield from self.wait_all()
                yield self._all_or_nothing(chunk, n, planner, accumulation)
                return
            size = int(min(planned, n - offset))
            piece = _batches.rows(chunk, offset, offset + size)
            if self.start is not None and not planner.measuring:
                started = yield from self._start(planner, piece, size, planned)
                if started:  # else it did not start (an OOM): try smaller
                    offset += size
                continue
            yield from self.wait_all()
            result = _attempt(self.model, self.phase, self.step, piece, size, planned, planner,
                              self.guard, self.detail, self.cut)
            if result is SPLIT:
                continue  # it ran out of memory: the planner chose a smaller size
            offset += size
            yield Piece(size, piece, result)

    def _start(self, planner: BatchPlanner, piece: Any, size: int,
               planned: float) -> Iterator[Piece]:
        """Start `piece` (waiting for the oldest beyond `AHEAD`); whether it started."""
        planner.started(size)
        try:
            started = self.start(piece)
        except Exception as exc:
            if not is_retryable_oom(exc):
                raise
            self.start = None  # one piece at a time from now on
            drop_frames(exc)  # before the earlier rows are handed on
            yield from self.wait_all()  # the earlier rows first
            _failed(self.model, self.phase, piece, planner, size, self.detail, exc)
            return False
        self.ahead.append(_Ahead(planner, piece, size, planned, started))
        if len(self.ahead) > AHEAD:
            yield from self._wait_oldest()
        return True

    def wait_all(self) -> Iterator[Piece]:
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
            _failed(self.model, self.phase, oldest.piece, oldest.planner, oldest.size,
                    self.detail, exc)
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

    def _all_or_nothing(self, chunk: Any, n: int, planner: BatchPlanner,
                        accumulation: Accumulation) -> Piece:
        """Run the `n` rows of `chunk` by `accumulation`, starting over smaller after an OOM."""
        guard = accumulation.guard
        while True:
            accumulation.begin()
            guard.snapshot()
            offset = size = parts = 0
            try:
                while offset < n:
                    planned = planner.next_size(n - offset)
                    size = int(min(planned, n - offset))
                    piece = _batches.rows(chunk, offset, offset + size)
                    planner.started(size)
                    accumulation.add(piece)
                    planner.succeeded(size, full=size >= planned)
                    offset += size
                    parts += 1
            except BaseException as exc:  # a KeyboardInterrupt too: leave the chunk undone
                guard.restore()
                if not is_retryable_oom(exc):
                    raise
                _failed(self.model, self.phase, chunk, planner, size, self.detail, exc)
                drop_frames(exc)
                continue
            return Piece(n, chunk, accumulation.finish(), parts)


def drop_frames(exc: BaseException) -> None:
    """Cut a caught OOM's frames (and its causes'), which hold the failed piece's buffers."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        exc.__traceback__ = None
        exc = exc.__cause__ or exc.__context__
    gc.collect()


def update_error(model: Any, chunk: Any, device: Optional[str], cause: str, rows: int,
                 held: Optional[str] = None) -> OutOfMemoryError:
    """The error for an OOM in an optimizer update (or its gradient sums) on `rows` rows."""
    return OutOfMemoryError(
        model.name, "train", _batches.shapes(_batches.rows(chunk[0], 0, 1)), device,
        cause=cause, rows=rows, held=held, can_place=can_place(model),
        can_shrink=can_shrink(model),
    )


def _failed(model: Any, phase: str, chunk: Any, planner: BatchPlanner, size: int, detail: str,
            exc: BaseException) -> None:
    """Tell `planner` that `size` rows ran out of memory; raise if one sample (a stateful
    model: `chunk`) does not fit."""
    if planner.failed(size):
        return
    stateful = planner.stateful  # its batches are never split
    raise OutOfMemoryError(
        getattr(model, "name", type(model).__name__),
        phase,
        _batches.shapes(_batches.rows(chunk[0], 0, 1)),
        planner.device,
        detail=detail,
        cause=CANNOT_SPLIT if stateful else ONE_SAMPLE,
        rows=_batches.num_rows(chunk) if stateful else None,
        can_place=can_place(model),
        stateful=stateful,
    ) from exc
