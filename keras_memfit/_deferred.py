"""A train step started but not yet known to have succeeded, and the logs Keras gets for it.

Keras's JAX loops never wait for a step: they dispatch the next one while the
last computes, and that overlap is most of what a small model's step costs.
A step that waited for its own result before returning (so that an OOM
surfaces inside the retry loop) would lose it. So when a whole batch runs as
one train step, MemFit (`keras_memfit._training.Run`) may *start* the step
and return at once, holding what it needs to run the batch again: the batch,
its planner, and the step itself, which keeps the state it started from
(`TrainStep.start` / `settle` in the backend). The step is *settled* (waited
for) before anything can depend on its result: before the next batch, before
Keras writes the state into the model's variables (the backend's trainer
hook), and when anyone reads the logs returned for it (`SettlingLogs`). If it
ran out of memory, the state goes back to where it started and the batch
runs again as MemFit runs any batch that does not fit, before any later step
or reader sees it; the logs Keras already holds are then replaced in place.
Settled outside MemFit's train function (a callback reading the logs), the
steps work on the state Keras holds then (the backend's `settling(model)`).

Settling belongs to the thread that started the step (Keras's loop). Keras
may read a batch's logs on a worker thread (its callbacks' asynchronous
dispatch); such a reader waits for the step's computation, as it would for
Keras's own logs (the step's `completion`), and reads the logs as they are if
it succeeded; if it failed, it waits until the loop's thread has run the
batch again and replaced them.

Example:
    >>> logs = SettlingLogs(step_logs, settle=run.settle)
    >>> float(logs["loss"])  # settles first on the loop's thread; waits elsewhere
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Dict, Hashable, List, Optional

from keras_memfit.oom import is_retryable_oom


class SettlingLogs(dict):
    """A step's logs that settle the step before any value is read.

    A dict, so Keras and callbacks use it as the logs they always get. Reading
    a value (`[]`, `get`, `items`, `values`, `copy`, `dict(logs)`, printing)
    first calls `settle()` on the thread that started the step. On any other
    thread it waits for the step's computation (`completed()`) and reads the
    values as they are if it succeeded (a step that succeeded is never run
    again: its logs are final), else waits for that thread to have settled
    it (and replaced the values). Keys need no settling (they do not change)
    and are read as a dict's.

    Args:
        logs: The step's logs (its not yet finished arrays).
        settle: Settles the step; it calls `resolve` on these logs.
        completed: Waits, on any thread, for the step's computation and
            returns whether it succeeded (`StartableTrainStep.completion`);
            None: readers on other threads always wait for `settle`.
    """

    def __init__(
        self,
        logs: Dict[str, Any],
        settle: Callable[[], None],
        completed: Optional[Callable[[], bool]] = None,
    ) -> None:
        super().__init__(logs)
        self._settle = settle
        self._completed = completed
        self._owner = threading.get_ident()
        self.resolved = False
        # Held until resolved: readers on other threads wait on it (cheaper
        # to make than a threading.Event, once per step).
        self._unresolved = threading.Lock()
        self._unresolved.acquire()

    def resolve(self, logs: Optional[Dict[str, Any]] = None) -> None:
        """The step is settled: replace the values by `logs` if given; wake any reader."""
        if logs is not None:
            dict.clear(self)
            dict.update(self, logs)
        if not self.resolved:
            self.resolved = True
            self._completed = None  # holds an array of the step's; not needed now
            self._unresolved.release()

    def wait(self) -> None:
        """Wait until `resolve` was called (on the thread that settles)."""
        if not self.resolved:
            with self._unresolved:
                pass

    def _settled(self) -> None:
        if self.resolved:
            return
        if threading.get_ident() == self._owner:
            self._settle()  # resolves these logs, if their step is still pending
            return
        completed = self._completed  # read once: the owner may clear it meanwhile
        if completed is None or not completed():
            self.wait()

    def __getitem__(self, key: Hashable) -> Any:
        self._settled()
        return dict.__getitem__(self, key)

    def __iter__(self):
        # Defined so that dict(logs) and {**logs} read through __getitem__.
        return dict.__iter__(self)

    def get(self, key: Hashable, default: Any = None) -> Any:
        self._settled()
        return dict.get(self, key, default)

    def items(self):
        self._settled()
        return dict.items(self)

    def values(self):
        self._settled()
        return dict.values(self)

    def copy(self) -> Dict[str, Any]:
        self._settled()
        return dict(dict.items(self))

    def __repr__(self) -> str:
        self._settled()
        return dict.__repr__(self)

    def __reduce__(self):
        self._settled()
        return (dict, (dict(dict.items(self)),))


@dataclasses.dataclass
class PendingBatch:
    """A training batch run as one started train step, not yet settled.

    Attributes:
        chunk: The batch, as a chunk (to run it again if the step failed).
        rows: Its rows.
        planner: The planner that let it run whole.
        step: The started step (`settle()` waits; raises if it failed).
        index: The batch's index in its epoch (`Run.step` when it started).
        logs: The logs returned to Keras for it (None if the start raised).
    """

    chunk: tuple
    rows: int
    planner: Any
    step: Any
    index: int
    logs: Optional[SettlingLogs] = None

    def owned_here(self) -> bool:
        """Whether this thread started the step (only it may settle it)."""
        return threading.get_ident() == self.logs._owner


class StartedSteps:
    """The train steps MemFit started and has not settled yet, oldest first.

    Args:
        rerun: `rerun(batch, failed, learn)` runs `batch` again, as MemFit runs
            a batch that may not fit, and returns its logs: `failed` for the
            batch whose step ran out of memory (the others were dropped with
            it), `learn` when the planner is to learn that failure at once.

    Attributes:
        overlap: Whether a step may start before the previous one is settled
            (True until the first OOM).
    """

    def __init__(self, rerun: Callable[[PendingBatch, bool, bool], Any]) -> None:
        self._batches: List[PendingBatch] = []
        self._rerun = rerun
        self.overlap = True

    def __bool__(self) -> bool:
        return bool(self._batches)

    def owned_here(self) -> bool:
        """Whether this thread started the steps (True when there are none)."""
        first = self._batches[:1]  # a slice: the loop's thread may empty the list meanwhile
        return not first or first[0].owned_here()

    def add(self, batch: PendingBatch) -> None:
        """Record a step just started."""
        self._batches.append(batch)

    def settle(self, keep_newest: bool = False) -> None:
        """Wait for the started steps; run again the batches of any that failed.

        A step that ran out of memory put the state back where it started
        and dropped the steps started after it. Its batch then runs again:
        first whole once more, if the step had overlapped the one before (the
        extra copy of the training state may be what did not fit; no step
        overlaps another after that), else as any batch that does not fit;
        then the dropped batches, in order. The logs Keras got for each are
        replaced in place. On a thread other than the one that started the
        steps, this waits for that one to settle them.

        Args:
            keep_newest: Leave the most recently started step unsettled.
        """
        batches = self._batches
        if not self.owned_here():
            for newest in batches[-1:]:
                newest.logs.wait()
            return
        while len(batches) > keep_newest:
            first = batches[0]
            try:
                first.step.settle()
            except BaseException as exc:
                self._batches = []
                try:
                    if not is_retryable_oom(exc):
                        raise
                    self._run_again(batches)
                finally:
                    for batch in batches:
                        batch.logs.resolve()  # whatever happened: no reader waits forever
                return
            batches.pop(0)
            first.logs.resolve()
            first.planner.succeeded(first.rows, full=True)
            first.planner.finish_batch()

    def run_again(self, batch: PendingBatch) -> Any:
        """Run the batch of a step whose start raised an OOM (earlier steps settled first)."""
        self.settle()
        overlapped, self.overlap = self.overlap, False
        return self._rerun(batch, True, not overlapped)

    def _run_again(self, batches: List[PendingBatch]) -> None:
        overlapped, self.overlap = self.overlap, False
        for i, batch in enumerate(batches):
            batch.logs.resolve(self._rerun(batch, i == 0, i == 0 and not overlapped))
