"""The planner's piece sizes follow the backend's `piece_multiple` (JAX's DataParallel).

A fake backend (monkeypatched behind `keras_memfit.backend.get`) says a piece
is laid out over two devices; no accelerator, TensorFlow or JAX is needed.
The expected sizes are the planner's halving on OOM, rounded down to even
sizes by hand.
"""

from __future__ import annotations

import pytest

from keras_memfit import backend as backend_module
from keras_memfit.planning.planner import GROW_AFTER, BatchPlanner
from planner_support import NoStatisticsBackend

SIG = ((("4",), "float32"),)



class _Model:
    name = "m"


@pytest.fixture
def two_devices(monkeypatch):
    devices = NoStatisticsBackend(multiple=2)  # steps that run any shape
    monkeypatch.setattr(backend_module, "get", lambda: devices)
    return devices


def _fail(planner, size):
    planner.started(size)
    return planner.failed(size)


def test_piece_sizes_are_multiples_of_the_devices_down_to_one_row_each(two_devices):
    planner = BatchPlanner(_Model(), "predict", SIG, requested=101)
    sizes = [planner.next_size()]
    while _fail(planner, sizes[-1]):
        sizes.append(planner.next_size())
    # 101 -> 100; halving 100, 50, 25 -> 24, 12, 6, 3 -> 2; a failed 2 is final.
    assert sizes == [100, 50, 24, 12, 6, 2]
    assert [e.new_size for e in planner.events] == [50, 24, 12, 6, 2]


def test_a_requested_size_below_the_devices_is_kept(two_devices):
    planner = BatchPlanner(_Model(), "predict", SIG, requested=1)
    assert planner.next_size() == 1  # runs whole on every device
    assert not _fail(planner, 1)


def test_memfit_growth_goes_to_a_multiple_that_runs_a_batch_as_fewer_pieces(two_devices):
    rows = 98
    planner = BatchPlanner(_Model(), "train", SIG, requested=rows, probe="after_oom")
    planner.start_batch(rows)
    assert _fail(planner, rows) and planner.next_size() == 48  # 49 -> 48
    assert _fail(planner, 48) and planner.next_size() == 24  # 24, 24, 24, 24, 2
    for _ in range(GROW_AFTER):
        planner.start_batch(rows)
        done = 0
        while done < rows:
            planned = planner.next_size()
            size = min(planned, rows - done)
            planner.started(size)
            planner.succeeded(size, full=size >= planned)
            done += size
        planner.finish_batch()
    # Three pieces: 33 rows each is not a multiple of two (it would run as 32, 32,
    # 32, 2: four pieces); 34, 34, 30 are.
    assert planner.events[-1].kind == "grow" and planner.events[-1].new_size == 34
    assert planner.next_size() == 34


def test_one_device_plans_as_before(monkeypatch):
    devices = NoStatisticsBackend(multiple=1)
    monkeypatch.setattr(backend_module, "get", lambda: devices)
    planner = BatchPlanner(_Model(), "predict", SIG, requested=101)
    assert planner.next_size() == 101
    assert _fail(planner, 101) and planner.next_size() == 50
    assert _fail(planner, 50) and planner.next_size() == 25
