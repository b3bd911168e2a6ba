"""Started, not yet settled, train steps and their logs (`keras_memfit/_deferred.py`).

Unit tests with stand-in steps and planners: reading the logs settles the
step on the thread that started it and waits on any other; a step that
fails when settled makes its batch, and the batches started after it, run
again, the first time whole (overlap off from then on), later with the
planner learning the failure; other errors pass through and wake every
reader. The JAX backend's real steps are tested in `test_jax_deferred.py`.
"""

from __future__ import annotations

import threading

import pytest

from keras_memfit._deferred import PendingBatch, SettlingLogs, StartedSteps
from support import oom_error


class FakeStep:
    """Settles its started steps in order; raises `errors[i]` at the i-th settle if set."""

    def __init__(self, errors=None):
        self.errors = dict(errors or {})
        self.started = 0
        self.settled = 0

    def settle(self):
        self.settled += 1
        error = self.errors.get(self.settled)
        if error is not None:
            self.started = 0  # the real step drops every started step with the failed one
            raise error
        self.started -= 1


class FakePlanner:
    def __init__(self):
        self.succeeded_rows = []

    def succeeded(self, size, full):
        self.succeeded_rows.append(size)

    def finish_batch(self):
        pass


def _batch(steps, step, index, planner, values=None):
    steps_logs = SettlingLogs(values or {"loss": float(index)}, steps.settle)
    batch = PendingBatch(("chunk", index), 8, planner, step, index, steps_logs)
    step.started += 1
    steps.add(batch)
    return steps_logs


def test_reading_the_logs_settles_on_the_starting_thread_and_replaces_values():
    settled = []
    logs = SettlingLogs({"loss": 1.0, "accuracy": 0.5}, lambda: settled.append(True))
    assert set(logs.keys()) == {"loss", "accuracy"} and not settled  # keys need no settling
    assert logs["loss"] == 1.0 and settled == [True]
    logs.resolve({"loss": 2.0, "accuracy": 0.25})  # the batch ran again
    assert dict(logs) == {"loss": 2.0, "accuracy": 0.25}
    assert {**logs} == logs.copy() == {"loss": 2.0, "accuracy": 0.25}
    assert len(settled) == 1  # resolved: no more settling


@pytest.mark.parametrize("read", [
    lambda logs: logs["loss"], lambda logs: dict(logs), lambda logs: list(logs.items()),
    lambda logs: logs.get("loss"), lambda logs: list(logs.values()), lambda logs: repr(logs),
])
def test_a_reader_on_another_thread_waits_until_the_step_is_settled(read):
    settles = []
    logs = SettlingLogs({"loss": 1.0}, lambda: settles.append(True))
    got = []
    reader = threading.Thread(target=lambda: got.append(read(logs)))
    reader.start()
    reader.join(0.2)
    assert reader.is_alive() and not got and not settles  # waiting, not settling
    logs.resolve({"loss": 3.0})
    reader.join(5)
    assert not reader.is_alive() and got and "3.0" in str(got[0])
    assert not settles


def test_a_reader_on_another_thread_reads_a_step_that_succeeded_without_waiting():
    settles, waited = [], threading.Event()

    def completed():  # the step's computation: waited for, and it succeeded
        waited.set()
        return True

    logs = SettlingLogs({"loss": 1.0}, lambda: settles.append(True), completed)
    got = []
    reader = threading.Thread(target=lambda: got.append(dict(logs)))
    reader.start()
    reader.join(5)
    assert not reader.is_alive() and got == [{"loss": 1.0}] and waited.is_set()
    assert not settles and not logs.resolved  # the loop's thread settles it later


def test_a_reader_on_another_thread_waits_for_the_rerun_of_a_step_that_failed():
    logs = SettlingLogs({"loss": 1.0}, lambda: None, lambda: False)  # the computation failed
    got = []
    reader = threading.Thread(target=lambda: got.append(logs["loss"]))
    reader.start()
    reader.join(0.2)
    assert reader.is_alive() and not got  # waits for the loop's thread
    logs.resolve({"loss": 4.0})  # the batch ran again
    reader.join(5)
    assert not reader.is_alive() and got == [4.0]


def test_resolving_drops_the_completion_and_readers_then_read_at_once():
    calls = []
    logs = SettlingLogs({"loss": 1.0}, lambda: None, lambda: calls.append(True) or True)
    logs.resolve()
    got = []
    reader = threading.Thread(target=lambda: got.append(logs["loss"]))
    reader.start()
    reader.join(5)
    assert got == [1.0] and not calls


def test_a_failed_settle_runs_the_batch_and_the_dropped_ones_again():
    reruns = []

    def rerun(batch, failed, learn):
        reruns.append((batch.index, failed, learn))
        return {"loss": 10.0 + batch.index}

    steps = StartedSteps(rerun)
    planner = FakePlanner()
    step = FakeStep({2: oom_error(8), 4: oom_error(8)})
    first, second = _batch(steps, step, 0, planner), _batch(steps, step, 1, planner)
    steps.settle(keep_newest=True)  # settles batch 0 only
    assert planner.succeeded_rows == [8] and first["loss"] == 0.0 and steps
    third = _batch(steps, step, 2, planner)
    assert steps.overlap
    steps.settle(keep_newest=True)  # batch 1 fails while batch 2 overlaps it
    assert reruns == [(1, True, False), (2, False, False)]  # tried whole first, in order
    assert not steps and not steps.overlap
    assert second["loss"] == 11.0 and third["loss"] == 12.0  # the logs Keras holds
    fourth = _batch(steps, step, 3, planner)
    steps.settle()  # settle 3 succeeds
    fifth = _batch(steps, step, 4, planner)
    steps.settle()  # settle 4 fails, overlap off: the planner learns it at once
    assert reruns[-1] == (4, True, True)
    assert fourth["loss"] == 3.0 and fifth["loss"] == 14.0


def test_a_start_that_raised_runs_its_batch_after_settling_the_others():
    reruns = []
    steps = StartedSteps(lambda batch, failed, learn: reruns.append((batch.index, failed, learn)))
    planner = FakePlanner()
    step = FakeStep()
    _batch(steps, step, 0, planner)
    failed = PendingBatch(("chunk", 1), 8, planner, step, 1)  # its start raised an OOM
    steps.run_again(failed)
    assert planner.succeeded_rows == [8] and reruns == [(1, True, False)]
    assert not steps.overlap


def test_other_errors_pass_through_and_wake_every_reader():
    steps = StartedSteps(lambda *args: pytest.fail("not an OOM: nothing runs again"))
    planner = FakePlanner()
    step = FakeStep({1: ValueError("a bug")})
    first, second = _batch(steps, step, 0, planner), _batch(steps, step, 1, planner)
    with pytest.raises(ValueError, match="a bug"):
        steps.settle()
    assert first.resolved and second.resolved and not steps
