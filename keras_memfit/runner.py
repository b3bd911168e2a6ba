"""Running a compiled step over chunks in pieces, retrying smaller on OOM.

This is the loop shared by `safe_predict` and `safe_evaluate` (and, later,
MemFit's validation): for every chunk, run the step on consecutive pieces of
the size the planner chooses; when a piece runs out of memory, undo what the
failed step touched, let the planner choose a smaller size and
carry on from the same offset. A `guard` (see `backend.guard_variables`)
snapshots the state a step may touch before every attempt and restores it
after a failed one. So every sample is in exactly one successful
piece, in input order. Errors that are not OOMs propagate untouched; a piece
of one sample that runs out of memory raises `OutOfMemoryError`.
"""

from __future__ import annotations

import gc
from typing import Any, Callable, Dict, Hashable, Iterable, Iterator, List, Optional

from keras_memfit import data as _data
from keras_memfit.oom import OutOfMemoryError, is_oom_error
from keras_memfit.planner import BatchPlanner, Event


def run_in_pieces(
    model: Any,
    phase: str,
    chunks: Iterable[Any],
    step: Callable[[Any], Any],
    on_piece: Callable[[int, Any, Any], bool],
    *,
    requested: Optional[int],
    guard: Any = None,
    events: Optional[List[Event]] = None,
    planner: Optional[BatchPlanner] = None,
) -> int:
    """Run `step` over every chunk in adaptive pieces.

    Args:
        model: The model (key for the planner's memory).
        phase: "predict", "evaluate" or "train".
        chunks: Iterable of chunk structures (see `keras_memfit.data`).
        step: Runs one piece; its first leaf of `x` decides the signature.
        on_piece: Called as `on_piece(num_rows, piece, result)` after each
            successful piece; returning True stops early.
        requested: Largest piece size, or None to be bounded by the chunks.
        guard: Object with `snapshot()` and `restore()`, called before every
            attempt and after a failed one, for state a step may touch.
        events: Receives one `Event` per adaptation.
        planner: A planner to use for every chunk instead of one per input
            signature (the caller keeps it across calls).

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
            size = int(min(planned, n - offset))
            piece = _data.rows(chunk, offset, offset + size)
            current.started(size)
            if guard is not None:
                guard.snapshot()
            try:
                result = step(piece)
            except Exception as exc:
                if not is_oom_error(exc) or isinstance(exc, OutOfMemoryError):
                    raise  # not an OOM, or one already judged final
                if guard is not None:
                    guard.restore()
                if not current.failed(size):
                    raise OutOfMemoryError(
                        getattr(model, "name", type(model).__name__),
                        phase,
                        _data.shapes(piece[0]),
                        current.device,
                    ) from exc
                del exc
                gc.collect()
                continue
            current.succeeded(size, full=size >= planned)
            offset += size
            done += size
            if on_piece(size, piece, result):
                return done
    return done


def prepend(first: Any, rest: Iterator[Any]) -> Iterator[Any]:
    """`first`, then the items of `rest`.

    Unlike `itertools.chain`, closing it (which dropping it does) closes
    `rest` too, so an input left unfinished (`steps`, an early stop) ends its
    epoch as soon as the run is over.
    """
    yield first
    yield from rest
