"""After an OOM with nothing known about memory, steps compiled per shape shrink far, not by half.

Issue 21, item 3: where the backend gives no memory statistics and no limit
(a platform whose `memory_stats()` is empty), halving paid an OOM and a
compilation per factor of two (1024 down to 16 in 6 OOMs). A fake backend
(behind `keras_memfit.backend.get`) gives no statistics; the analytic
estimate is replaced by hand-chosen (bytes per sample, fixed bytes), and
the expected sizes are worked out by hand below. The real OOMs are in
tests/test_jax_few_ooms.py.
"""

from __future__ import annotations

import pytest

from keras_memfit import backend as backend_module
from keras_memfit.planning import planner as planner_module
from keras_memfit.planning.planner import BatchPlanner
from planner_support import NoStatisticsBackend

SIG = ((("4",), "float32"),)



class _Model:
    name = "m"


def _planner(monkeypatch, compiles, estimate, phase="predict", requested=28000):
    monkeypatch.setattr(backend_module, "get", lambda: NoStatisticsBackend(compiles=compiles))
    monkeypatch.setattr(planner_module, "analytic_estimate", lambda model, phase: estimate)
    return BatchPlanner(_Model(), phase, SIG, requested=requested)


def _fail(planner, size):
    planner.started(size)
    assert planner.failed(size)
    return planner.next_size()


@pytest.mark.parametrize("estimate, requested, expected", [
    ((240_000.0, 0), 28000, [3500, 437]),  # no fixed part: an eighth of the rows each time
    (None, 28000, [3500, 437]),  # no estimate: the rows themselves
    # 1024 * 4 MB + 100 MB = 4196 MB; an eighth, 524.5 MB, less 100 MB: 106 rows;
    # then 524 MB / 8 is below the 100 MB fixed part: the floor, 106 // 64 = 1.
    ((4e6, 100_000_000), 1024, [106, 1]),
    # The fixed part is most of it (1224 MB / 8 < 200 MB): 1/64 of the rows, the floor.
    ((1e6, 200_000_000), 1024, [16, 1]),
])
def test_an_oom_shrinks_to_an_eighth_of_the_estimated_need(monkeypatch, estimate, requested,
                                                           expected):
    planner = _planner(monkeypatch, True, estimate, requested=requested)
    assert planner.next_size() == requested
    sizes = [_fail(planner, requested)]
    sizes.append(_fail(planner, sizes[-1]))
    assert sizes == expected
    assert [e.kind for e in planner.events] == ["oom", "oom"]


def test_the_size_is_evened_over_the_rows_it_splits(monkeypatch):
    planner = _planner(monkeypatch, True, (4e6, 100_000_000), requested=1024)
    planner.started(1024)
    planner.failed(1024)
    assert planner.next_size(rows=1024) == 103  # 10 pieces of 103 or less (by hand)


def test_a_later_call_stays_at_what_worked_and_pays_no_oom(monkeypatch):
    _planner(monkeypatch, True, None)
    model = _Model()
    first = BatchPlanner(model, "predict", SIG, requested=28000)
    first.started(28000)
    first.failed(28000)
    first.succeeded(3500, full=True)
    second = BatchPlanner(model, "predict", SIG, requested=28000)
    assert second.next_size() == 3500


def test_steps_that_run_any_shape_still_halve(monkeypatch):
    planner = _planner(monkeypatch, False, (240_000.0, 0))
    assert _fail(planner, 28000) == 14000
