"""The batch loop of `safe_predict` and `safe_evaluate`: Keras's plumbing around `run_in_pieces`."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import keras

from keras_memfit import backend as _backend
from keras_memfit.backend.base import StartedPiece
from keras_memfit.planning import data as _data
from keras_memfit.planning.runner import Piece, run_in_pieces

# phase (as the planner names it) -> (Keras's callback hook prefix, the model's stop flag)
_HOOKS = {"predict": ("predict", "stop_predicting"), "evaluate": ("test", "stop_evaluating")}


def requested_size(
    source: _data.Chunks, batch_size: Optional[int], max_batch_size: Optional[int] = None
) -> Optional[int]:
    """The largest piece: the batch size for arrays (None if batched), at most `max_batch_size`."""
    requested = (batch_size or _data.DEFAULT_BATCH_SIZE) if source.from_arrays else None
    if max_batch_size is not None:
        requested = max_batch_size if requested is None else min(requested, max_batch_size)
    return requested


class BatchLoop:
    """Callbacks, progress bar and stop flag around one `run_in_pieces` run.

    Use: `begin()`; loop over `pieces(...)`, calling `batch_ended` after each piece and leaving
    when it returns True; `data_ended(...)`; `end(...)`.
    """

    def __init__(
        self,
        model: keras.Model,
        phase: str,
        *,
        callbacks: Optional[Sequence[keras.callbacks.Callback]],
        verbose: int,
        num_samples: Optional[int],
        merge_logs: Optional[Callable[[list], Any]] = None,
    ) -> None:
        """`merge_logs`: one execution's logs from its batches' (default: the last batch's)."""
        self.model = model
        self.phase = phase
        prefix, self._stop_flag = _HOOKS[phase]
        self.num_samples = num_samples
        self.callbacks = keras.callbacks.CallbackList(
            callbacks, add_progbar=False, model=model, verbose=verbose, epochs=1
        )
        self.progbar = (
            keras.utils.Progbar(num_samples, verbose=verbose, unit_name="sample")
            if verbose else None
        )
        # Else callers skip reading the logs back, which would serialise the steps.
        self.shows_logs = self.progbar is not None or bool(callbacks)
        self._on_begin = getattr(self.callbacks, f"on_{prefix}_begin")
        self._on_batch_begin = getattr(self.callbacks, f"on_{prefix}_batch_begin")
        self._on_batch_end = getattr(self.callbacks, f"on_{prefix}_batch_end")
        self._on_end = getattr(self.callbacks, f"on_{prefix}_end")
        # Whether any callback has its own `on_*_batch_{begin,end}` (none: pieces start ahead).
        self._batch_hooks = any(
            getattr(getattr(callback, f"on_{prefix}_batch_{event}"), "__func__", None)
            is not getattr(keras.callbacks.Callback, f"on_{prefix}_batch_{event}")
            for callback in self.callbacks.callbacks
            for event in ("begin", "end")
        )
        self.batch = 0
        self.done = 0
        self._begun = -1
        self._per_execution = max(1, int(getattr(model, "steps_per_execution", 1) or 1))
        self._merge_logs = merge_logs or (lambda logs: logs[-1])
        self._execution_logs: list = []  # logs of the open execution's batches

    def begin(self) -> None:
        """Clear the model's stop flag and send `on_{predict,test}_begin`."""
        setattr(self.model, self._stop_flag, False)
        self._on_begin()

    def pieces(
        self,
        chunks: Iterable[Any],
        step: Callable[[Any], Any],
        *,
        requested: Optional[int],
        guard: Any = None,
        start: Optional[Callable[[Any], Any]] = None,
    ) -> Iterator[Piece]:
        """`run_in_pieces` over `chunks`; `start` (ahead) only where no callback has batch hooks."""

        def attempt(piece: Any) -> Any:
            self._begin_batch()
            return step(piece)

        return run_in_pieces(
            self.model, self.phase, chunks, attempt,
            requested=requested, guard=guard,
            start=None if self._batch_hooks else start,
        )

    def batch_ended(self, rows: int, logs: Any, values: Optional[list] = None) -> bool:
        """Count a finished piece of `rows` and send its `on_*_batch_end`; True when stopped."""
        self._begin_batch()  # a piece started ahead (`start`) began here for the hooks
        self.batch += 1
        self.done += rows
        if self.progbar is not None:
            self.progbar.update(self.done, values=values, finalize=self.done == self.num_samples)
        self._execution_logs.append(logs)
        if self.batch % self._per_execution:
            return False
        self._end_execution()
        return self._stopped()

    def _begin_batch(self) -> None:
        """Send the current batch's `on_*_batch_begin` once (not again for a retry)."""
        if self._begun != self.batch:
            if self.batch % self._per_execution == 0:
                self._on_batch_begin(self.batch)
            self._begun = self.batch

    def data_ended(self, source: _data.Chunks, steps: Optional[int]) -> None:
        """After the loop: close a last, shorter execution, and send the `on_*_batch_begin` Keras
        sends before it finds the input ended (always for a generator)."""
        if self._execution_logs:
            self._end_execution()
        if self._stopped() or source.from_arrays:
            return
        if not _backend.get().KERAS_BEGINS_BATCH_BEFORE_FETCH:
            return  # torch: Keras's loop fetches the batch first (no begin without one)
        expected = steps or source.num_batches
        if expected is not None and self.batch >= expected:
            return
        spe = self._per_execution
        self._on_batch_begin(-(-self.batch // spe) * spe)

    def _end_execution(self) -> None:
        spe = self._per_execution
        begin = (self.batch - 1) // spe * spe
        logs = self._merge_logs(self._execution_logs)
        self._execution_logs = []
        self._on_batch_end(begin + spe - 1, logs)  # Keras's end index, also when short

    def _stopped(self) -> bool:
        return bool(getattr(self.model, self._stop_flag, False))

    def end(self, logs: Any = None, values: Optional[list] = None) -> None:
        """Finish the progress bar (stopped early, or of unknown length) and send `on_*_end`."""
        if self.progbar is not None and self.done != self.num_samples:
            self.progbar.update(self.done, values=values, finalize=True)
        self._on_end(logs)


class Then:
    """A started piece whose result `wait()` passes through `fn` (a `StartedPiece` too)."""

    def __init__(self, started: StartedPiece, fn: Callable[[Any], Any]) -> None:
        self._started, self._fn = started, fn

    def wait(self) -> Any:
        return self._fn(self._started.wait())

    def undo(self) -> None:
        self._started.undo()


def prepend(first: Any, rest: Iterator[Any]) -> Iterator[Any]:
    """`first`, then `rest`; unlike `itertools.chain`, closing it closes `rest` (ends its epoch)."""
    yield first
    yield from rest
