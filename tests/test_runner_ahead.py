"""`run_in_pieces` with steps started ahead of the one waited for (`start=`; JAX's use it).

A fake startable step keeps a running sum as its "state" (as a test step's
metrics): starting it on a piece adds the piece's rows at once, waiting for
it may fail (as a computation that ran out of memory after it was
dispatched), and a failed wait or an `undo` puts the sum back. The reference
is the sum and the order of the rows themselves: every row is handed to
yielded exactly once, in input order, and the state counts exactly the
rows handed over.
"""

from __future__ import annotations

import weakref

import numpy as np
import pytest

from keras_memfit.planning import runner
from keras_memfit.planning.runner import run_in_pieces


@pytest.fixture(autouse=True, params=[1, 2], ids=["1-ahead", "2-ahead"])
def ahead(request, monkeypatch):
    """Each test with one piece and with two pieces left started ahead."""
    monkeypatch.setattr(runner, "AHEAD", request.param)
    return request.param


class _Model:
    name = "fake"


class _FakeStep:
    """A startable step over `(x,)` pieces whose state is the sum of the rows run.

    Args:
        fail_wait: First rows of pieces whose first wait raises `MemoryError`
            (an OOM), or `error` when given.
        fail_start: First rows of pieces whose first start raises `MemoryError`
            (an OOM at once).
        error: What a failing wait raises instead of `MemoryError`.
    """

    def __init__(self, fail_wait=(), fail_start=(), error=None):
        self.state = 0.0
        self.calls = []  # ("start", first row, rows) / ("wait", ...) / ("call", ...)
        self._fail_wait = set(fail_wait)
        self._fail_start = set(fail_start)
        self._error = error

    def __call__(self, piece):
        x = piece[0]
        self.calls.append(("call", int(x[0]), len(x)))
        self.state += float(x.sum())
        return x * 2

    def start(self, piece):
        x = piece[0]
        self.calls.append(("start", int(x[0]), len(x)))
        if int(x[0]) in self._fail_start:
            self._fail_start.discard(int(x[0]))
            raise MemoryError("out of memory at once")
        before = self.state
        self.state += float(x.sum())
        step = self

        class Started:
            def wait(self):
                step.calls.append(("wait", int(x[0]), len(x)))
                if int(x[0]) in step._fail_wait:
                    step._fail_wait.discard(int(x[0]))
                    step.state = before
                    raise step._error or MemoryError("out of memory when computed")
                return x * 2

            def undo(self):
                step.state = before

        return Started()


def _run(step, rows=40, requested=8, stop_after=None):
    x = np.arange(rows, dtype=np.float64)
    seen = []
    done = 0
    for piece in run_in_pieces(_Model(), "predict", [(x,)], step,
                               requested=requested, start=step.start):
        np.testing.assert_array_equal(piece.result, piece.data[0] * 2)
        seen.extend(piece.data[0].astype(int).tolist())
        done += piece.rows
        if stop_after is not None and len(seen) >= stop_after:
            break  # leaving the loop undoes the pieces started ahead
    return done, seen


def _overlapped(calls):
    """Whether some piece started before the one started before it was waited for."""
    started = waited = 0
    for kind, *_ in calls:
        if kind == "start":
            if started > waited:
                return True
            started += 1
        elif kind == "wait":
            waited += 1
    return False


def test_each_piece_starts_before_the_previous_one_is_waited_for_and_all_rows_arrive_in_order():
    step = _FakeStep()
    done, seen = _run(step)
    assert done == 40 and seen == list(range(40))
    assert step.state == sum(range(40))
    assert _overlapped(step.calls)
    assert [c for c in step.calls if c[0] == "start"] == [("start", i, 8) for i in range(0, 40, 8)]


def test_a_piece_that_fails_when_waited_for_runs_again_smaller_with_the_pieces_started_after_it(
        ahead):
    step = _FakeStep(fail_wait={16})  # the third piece, while the next run on its state
    done, seen = _run(step)
    assert done == 40 and seen == list(range(40))
    assert step.state == sum(range(40))  # the dropped fourth piece counted once
    failed = step.calls.index(("wait", 16, 8))
    assert ("start", 24, 8) in step.calls[:failed]  # it had started, on the failed state
    assert (("start", 32, 8) in step.calls[:failed]) == (ahead == 2)
    after = step.calls[failed + 1:]
    assert {kind for kind, *_ in after} == {"call"}  # then one piece at a time
    # The failed rows first, in smaller pieces (how much smaller is the planner's
    # choice: halves where it knows memory, less where it knows nothing).
    assert after[0][:2] == ("call", 16) and after[0][2] < 8


def test_a_piece_that_fails_when_started_comes_after_the_piece_started_before_it():
    step = _FakeStep(fail_start={8})
    done, seen = _run(step, rows=24)
    assert seen == list(range(24)) and step.state == sum(range(24))
    assert step.calls[:3] == [("start", 0, 8), ("start", 8, 8), ("wait", 0, 8)]
    # Then one at a time, smaller, from the failed rows on, in order.
    after = step.calls[3:]
    assert {kind for kind, *_ in after} == {"call"} and all(n < 8 for _, _, n in after)
    starts = [start for _, start, _ in after]
    assert starts[0] == 8 and starts == sorted(starts)
    assert sum(n for _, _, n in after) == 16


def test_a_stop_undoes_the_piece_started_ahead():
    step = _FakeStep()
    done, seen = _run(step, stop_after=16)
    assert done == 16 and seen == list(range(16))
    assert ("start", 16, 8) in step.calls  # started ahead, never handed over
    assert step.state == sum(range(16))


def test_an_error_that_is_not_an_oom_passes_through_with_the_state_put_back():
    error = ValueError("a bug in the model")
    step = _FakeStep(fail_wait={16}, error=error)
    with pytest.raises(ValueError) as info:
        _run(step)
    assert info.value is error
    assert step.state == sum(range(16))  # the failed piece and the one after it undone


def test_an_interrupt_while_waiting_leaves_the_state_of_the_pieces_handed_over():
    step = _FakeStep(fail_wait={16}, error=KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        _run(step)
    assert step.state == sum(range(16))


def test_without_start_pieces_run_one_at_a_time():
    step = _FakeStep()
    x = np.arange(24, dtype=np.float64)
    for _ in run_in_pieces(_Model(), "predict", [(x,)], step, requested=8):
        pass
    assert [kind for kind, *_ in step.calls] == ["call"] * 3


class _HoldingStep(_FakeStep):
    """A `_FakeStep` whose failure is raised from a frame holding a large buffer.

    Records, at every later call (the retry), whether that buffer is still
    alive: the caught OOM's traceback holds the failed frame's locals, so the
    retry would run with the failed piece's memory still taken.
    """

    def __init__(self, where, **kwargs):
        super().__init__(**kwargs)
        self.where = where
        self.buffers = []
        self.alive_at_retry = []

    def _hold_and_fail(self, fail):
        buffer = np.ones(1 << 16)  # the failed piece's activations
        self.buffers.append(weakref.ref(buffer))
        fail()

    def __call__(self, piece):
        self.alive_at_retry.append(any(ref() is not None for ref in self.buffers))
        if self.where == "call" and not self.buffers:
            self._hold_and_fail(lambda: (_ for _ in ()).throw(MemoryError("out of memory")))
        return super().__call__(piece)

    def start(self, piece):
        if self.where == "start" and not self.buffers:
            self._hold_and_fail(lambda: super(_HoldingStep, self).start(piece))
        started = super().start(piece)
        if self.where != "wait" or self.buffers:
            return started
        step = self

        class HoldingStarted:
            def wait(self):
                step._hold_and_fail(started.wait)

            def undo(self):
                started.undo()

        return HoldingStarted()


@pytest.mark.parametrize("where", ["call", "start", "wait"])
def test_the_failed_pieces_memory_is_free_before_the_retry(where):
    # "call": a piece run one at a time (no start); "start": an OOM at once;
    # "wait": an OOM found when the started piece is waited for.
    step = _HoldingStep(where, fail_start={0} if where == "start" else (),
                        fail_wait={0} if where == "wait" else ())
    x = np.arange(24, dtype=np.float64)
    seen = []
    for piece in run_in_pieces(_Model(), "predict", [(x,)], step, requested=8,
                               start=None if where == "call" else step.start):
        seen.extend(piece.data[0].astype(int).tolist())
    assert seen == list(range(24))
    assert step.buffers and step.alive_at_retry, "no failure and retry happened"
    assert not any(step.alive_at_retry)
