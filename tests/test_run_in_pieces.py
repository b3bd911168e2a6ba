"""`runner.run_in_pieces` end to end, with a fake step raising real OOM errors of the active backend."""

from __future__ import annotations

import numpy as np
import pytest

from keras_memfit.oom import OutOfMemoryError
from keras_memfit.planning import runner
from planner_support import (  # noqa: F401, F811 (device and model are fixtures)
    MiB,
    device,
    model,
)
from support import oom_error, oom_error_class, runtime_error

pytestmark = pytest.mark.usefixtures("probing_planner")


# --------------------------------------------------------------------------
# End to end: runner.run_in_pieces with a fake step
# --------------------------------------------------------------------------
def _oom(rows):
    return oom_error(rows)


class FakeStep:
    """Fails above `threshold` rows, and on the call numbers in `spikes` (rows > 1)."""

    def __init__(self, threshold=None, spikes=()):
        self.threshold = threshold
        self.spikes = set(spikes)
        self.calls = []
        self.rollbacks = 0
        self.snapshots = 0
        self.seen = []

    def __call__(self, piece):
        (x,) = piece
        rows = len(x)
        index = len(self.calls)
        self.calls.append(rows)
        if (self.threshold is not None and rows > self.threshold) or (
            index in self.spikes and rows > 1
        ):
            raise _oom(rows)
        return x * 2

    # The runner's guard protocol: snapshot before every attempt, restore after a failure.
    def snapshot(self):
        self.snapshots += 1

    def restore(self):
        self.rollbacks += 1

    def on_piece(self, size, piece, result):
        assert size == len(piece[0]) == len(result)
        np.testing.assert_array_equal(result, piece[0] * 2)
        self.seen.append(np.array(piece[0]))
        return False


def _consume(pieces, on_piece=None):
    """Read `run_in_pieces`'s pieces as the front ends do; the rows run.

    `on_piece(rows, data, result)` returning True leaves the loop.
    """
    done = 0
    for piece in pieces:
        done += piece.rows
        if on_piece is not None and on_piece(piece.rows, piece.data, piece.result):
            break
    return done


@pytest.mark.parametrize("stats", [False, True])
@pytest.mark.parametrize("requested", [1000, 37, None])
def test_run_in_pieces_processes_every_row_once_in_order(device, model, stats, requested):
    device(capacity=10_000 * MiB if stats else None, stats=stats)
    x = np.arange(2000)
    chunks = [(x[:700],), (x[700:710],), (x[710:1999],), (x[1999:],)]
    step = FakeStep(threshold=90, spikes={5, 11, 40, 41})
    events = []
    done = _consume(runner.run_in_pieces(
        model, "predict", chunks, step, requested=requested, guard=step, events=events,
    ), step.on_piece)
    assert done == 2000
    np.testing.assert_array_equal(np.concatenate(step.seen), x)
    ooms = [e for e in events if e.kind == "oom"]
    assert step.rollbacks == len(ooms) == len(step.calls) - len(step.seen)
    assert step.snapshots == len(step.calls)
    assert ooms
    assert all(len(piece) <= 90 for piece in step.seen)
    if requested is not None:
        assert max(step.calls) <= requested


def test_run_in_pieces_splits_each_dataset_batch(device, model):
    device(stats=False)
    batches = [(np.arange(i * 50, (i + 1) * 50),) for i in range(6)]
    step = FakeStep(threshold=20)
    done = _consume(runner.run_in_pieces(model, "evaluate", batches, step,
                                         requested=None, guard=step), step.on_piece)
    assert done == 300
    np.testing.assert_array_equal(np.concatenate(step.seen), np.arange(300))
    # 50 -> 25 -> 12 on the first batch; later batches start small.
    assert step.calls[:3] == [50, 25, 12]
    assert all(len(piece) <= 20 for piece in step.seen)
    assert step.rollbacks <= 3
    assert 50 not in step.calls[3:] and 25 not in step.calls[3:]


def test_run_in_pieces_second_call_pays_no_oom(device, model):
    device(stats=False)
    x = np.arange(500)
    first = FakeStep(threshold=60)
    _consume(runner.run_in_pieces(model, "predict", [(x,)], first, requested=256),
             first.on_piece)
    assert first.rollbacks == 0 and len(first.calls) > len(first.seen)
    second = FakeStep(threshold=60)
    _consume(runner.run_in_pieces(model, "predict", [(x,)], second,
                                  requested=256, guard=second), second.on_piece)
    assert len(second.calls) == len(second.seen)
    assert second.rollbacks == 0
    np.testing.assert_array_equal(np.concatenate(second.seen), x)


def test_run_in_pieces_stops_when_the_loop_is_left(device, model):
    device(stats=False)
    step = FakeStep()
    pieces = []
    for piece in runner.run_in_pieces(model, "predict", [(np.arange(100),)], step,
                                      requested=10):
        pieces.append(piece.rows)
        if len(pieces) == 3:
            break
    assert sum(pieces) == 30
    assert step.calls == [10, 10, 10]


def test_run_in_pieces_propagates_other_errors_untouched(device, model):
    device(stats=False)
    error = runtime_error("bad shape")
    guard = FakeStep()

    def step(piece):
        raise error

    with pytest.raises(type(error)) as info:
        _consume(runner.run_in_pieces(model, "predict", [(np.arange(10),)], step,
                                      requested=4, guard=guard))
    assert info.value is error
    assert guard.rollbacks == 0


def test_run_in_pieces_single_sample_oom_raises_out_of_memory_error(device, model):
    device(stats=False)
    step = FakeStep(threshold=0)
    with pytest.raises(OutOfMemoryError) as info:
        _consume(runner.run_in_pieces(model, "evaluate", [(np.arange(10.0).reshape(5, 2),)],
                                      step, requested=4, guard=step), step.on_piece)
    err = info.value
    assert isinstance(err, oom_error_class())
    assert isinstance(err.__cause__, oom_error_class())
    assert err.phase == "evaluate" and err.model_name == "dummy"
    assert err.batch_shape == ((1, 2),)
    assert err.device == "FAKE:0"
    assert step.calls == [4, 2, 1]
    assert step.rollbacks == 3
    assert step.seen == []


def test_run_in_pieces_uses_one_planner_per_signature(device, model):
    device(stats=False)
    # Two signatures alternate; only the wide rows are expensive.
    wide = [(np.zeros((40, 8)),), (np.zeros((40, 8)),)]
    narrow = [(np.zeros((40, 2)),), (np.zeros((40, 2)),)]
    calls = []

    def step(piece):
        x = piece[0]
        calls.append(x.shape)
        if x.shape[1] == 8 and len(x) > 10:
            raise _oom(len(x))
        return x

    _consume(runner.run_in_pieces(model, "predict", [wide[0], narrow[0], wide[1], narrow[1]],
                                  step, requested=40))
    narrow_calls = [s[0] for s in calls if s[1] == 2]
    assert narrow_calls == [40, 40]
    wide_calls = [s[0] for s in calls if s[1] == 8]
    assert wide_calls[:3] == [40, 20, 10]
    assert max(wide_calls[3:]) <= 10


@pytest.mark.parametrize("threshold", [None, 30, 0])
def test_run_whole_then_run_in_pieces_runs_as_run_in_pieces_alone(device, model, threshold):
    """The reference: `run_in_pieces` alone on a fresh planner (another model, no knowledge)."""
    from keras_memfit.planning.planner import BatchPlanner
    from planner_support import Dummy

    device(stats=False)
    x = np.arange(100)

    def run(use_whole, on_model):
        step = FakeStep(threshold=threshold)
        planner = BatchPlanner(on_model, "train", ("sig",), None, [], probe="after_oom")
        planner.start_batch(len(x))
        try:
            result = runner.SPLIT
            if use_whole:
                result = runner.run_whole(on_model, "train", (x,), step, planner, guard=step)
            if result is runner.SPLIT:
                _consume(runner.run_in_pieces(on_model, "train", [(x,)], step, requested=None,
                                              planner=planner, guard=step), step.on_piece)
            else:
                step.on_piece(len(x), (x,), result)
        except OutOfMemoryError as err:
            return step, err.batch_shape
        return step, None

    whole, whole_error = run(True, model)
    alone, alone_error = run(False, Dummy("other"))
    assert whole.calls == alone.calls
    assert (whole.snapshots, whole.rollbacks) == (alone.snapshots, alone.rollbacks)
    assert whole_error == alone_error
    assert [list(p) for p in whole.seen] == [list(p) for p in alone.seen]
    if threshold is None:
        assert whole.calls == [100]  # run whole, once
