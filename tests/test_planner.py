"""BatchPlanner against a simulated device (planner_support.py): probing, estimating, shrinking, growing back."""

from __future__ import annotations

import logging
import math

import pytest

from keras_memfit import backend as backend_module
from keras_memfit.planning.planner import (
    GROW_AFTER,
    MARGIN,
    MIN_PROBE_REQUEST,
    PROBE_SIZES,
    BatchPlanner,
    knowledge_for,
)
from planner_support import (  # noqa: F401, F811 (device and model are fixtures)
    SIG,
    FakeDevice,
    MiB,
    attempt,
    device,
    drive,
    expected_estimate,
    model,
)

pytestmark = pytest.mark.usefixtures("probing_planner")


# --------------------------------------------------------------------------
# Probing and estimating
# --------------------------------------------------------------------------
def test_constants_are_sane():
    assert PROBE_SIZES == (16, 64)
    assert MIN_PROBE_REQUEST == 128
    assert 0 < MARGIN < 1
    assert GROW_AFTER >= 1


@pytest.mark.parametrize("requested", [128, 1000, None])
def test_probes_run_16_then_64_when_stats_exist(device, model, requested):
    dev = device(capacity=4000 * MiB, per_sample=MiB, fixed=5 * MiB)
    planner = BatchPlanner(model, "predict", SIG, requested)
    assert planner.next_size() == 16
    assert attempt(planner, dev, 10_000) == (16, True)
    assert planner.next_size() == 64
    assert attempt(planner, dev, 10_000) == (64, True)
    assert planner.next_size() not in PROBE_SIZES
    # The peak was reset before each probe, so each was measured on its own.
    assert dev.resets == 2


def test_probe_results_count_as_real_work(device, model):
    dev = device(capacity=4000 * MiB)
    planner = BatchPlanner(model, "predict", SIG, 1000)
    log = drive(planner, dev, 300)
    assert [s for s, _ in log[:2]] == [16, 64]
    assert sum(s for s, ok in log if ok) == 300


@pytest.mark.parametrize("requested", [1, 32, 127])
def test_no_probes_below_the_probe_threshold(device, model, requested):
    device(capacity=4000 * MiB)
    assert BatchPlanner(model, "predict", SIG, requested).next_size() == requested


def test_no_probes_without_stats(device, model):
    device(capacity=4000 * MiB, stats=False)
    assert BatchPlanner(model, "predict", SIG, 1000).next_size() == 1000


def test_no_probes_where_no_limit_is_known(device, model):
    dev = device(capacity=4000 * MiB, report_limit=False)  # statistics, no limit
    assert BatchPlanner(model, "predict", SIG, 1000).next_size() == 1000
    assert dev.resets == 0


def test_probes_only_where_the_analytic_estimate_is_near_the_free_memory(
        device, model, monkeypatch):
    from keras_memfit.planning import planner as planner_module

    device(capacity=4000 * MiB, current=800 * MiB)  # 3200 MiB free
    monkeypatch.setattr(planner_module, "analytic_estimate", lambda m, phase: (MiB, 8 * MiB))
    # 192 rows need 200 MiB by the estimate: 1/16 of what is free, far.
    assert BatchPlanner(model, "predict", SIG, 192).next_size() == 192
    # 193 rows and more are near: measured first.
    assert BatchPlanner(model, "predict", SIG, 193).next_size() == PROBE_SIZES[0]
    # Unbounded: the first chunk's rows decide.
    assert BatchPlanner(model, "predict", SIG, None).next_size(150) == math.inf
    assert BatchPlanner(model, "predict", SIG, None).next_size(5000) == PROBE_SIZES[0]


def test_estimate_keeps_the_peak_within_margin_of_free_memory(device, model):
    dev = device(capacity=1000 * MiB, current=100 * MiB, per_sample=MiB, fixed=10 * MiB)
    events = []
    planner = BatchPlanner(model, "evaluate", SIG, 4096, events)
    attempt(planner, dev, 10_000)
    attempt(planner, dev, 10_000)
    chosen = planner.next_size()
    free = dev.capacity - dev.current
    assert chosen < 4096
    assert dev.need(chosen) - dev.current <= MARGIN * free
    # Not needlessly small either: within 20% of the largest size the margin allows.
    best = (MARGIN * free - dev.fixed) // dev.per_sample
    assert chosen >= 0.8 * best
    assert chosen == expected_estimate(dev)
    assert [(e.kind, e.old_size, e.new_size) for e in events] == [("estimate", 4096, chosen)]
    assert events[0].phase == "evaluate"


def test_estimate_then_runs_without_any_oom(device, model):
    dev = device(capacity=800 * MiB, current=50 * MiB, per_sample=2 * MiB, fixed=20 * MiB)
    planner = BatchPlanner(model, "predict", SIG, 10_000)
    log = drive(planner, dev, 5000)
    assert dev.ooms() == []
    assert max(s for s, _ in log) <= 10_000
    assert all(dev.need(s) <= dev.capacity for s, _ in log)


def test_estimate_never_exceeds_the_request(device, model):
    dev = device(capacity=100_000 * MiB, per_sample=MiB)
    events = []
    planner = BatchPlanner(model, "predict", SIG, 200, events)
    log = drive(planner, dev, 2000)
    assert [s for s, _ in log[:2]] == [16, 64]
    assert max(s for s, _ in log) == 200
    assert all(s <= 200 for s, _ in log)
    assert [e.kind for e in events] == []


def test_estimate_with_unbounded_request_uses_the_estimate(device, model):
    dev = device(capacity=1000 * MiB, per_sample=MiB)
    planner = BatchPlanner(model, "predict", SIG, None)
    attempt(planner, dev, 10_000)
    attempt(planner, dev, 10_000)
    assert planner.next_size() == expected_estimate(dev)


def test_inexact_limit_is_not_trusted_before_an_oom(device, model):
    dev = device(capacity=1000 * MiB, exact=False, per_sample=MiB)
    planner = BatchPlanner(model, "predict", SIG, 4096)
    assert planner.next_size() == 4096  # no probes either: the batch Keras would run
    assert dev.resets == 0


def test_a_later_planner_reuses_the_per_sample_cost_without_probing(device, model):
    dev = device(capacity=1000 * MiB, per_sample=MiB)
    first = BatchPlanner(model, "predict", SIG, 4096)
    drive(first, dev, 200)
    resets = dev.resets
    # Memory got tighter since: the next call's estimate follows it.
    dev.current = 500 * MiB
    second = BatchPlanner(model, "predict", SIG, 4096)
    assert second.next_size() == expected_estimate(dev)
    attempt(second, dev, 10_000)
    assert dev.resets == resets  # no probe


# --------------------------------------------------------------------------
# Shrinking on OOM
# --------------------------------------------------------------------------
def test_without_stats_starts_at_request_and_halves(device, model):
    dev = device(stats=False, fail_above=100)
    planner = BatchPlanner(model, "predict", SIG, 1000)
    log = drive(planner, dev, 1000)
    assert log[:4] == [(1000, False), (500, False), (250, False), (125, False)]
    assert log[4] == (62, True)
    assert sum(s for s, ok in log if ok) == 1000


def test_failed_at_one_sample_gives_up(device, model):
    device(stats=False)
    planner = BatchPlanner(model, "predict", SIG, 1)
    planner.started(1)
    assert planner.failed(1) is False


def test_failed_at_one_sample_gives_up_with_stats(device, model):
    device(capacity=100 * MiB)
    planner = BatchPlanner(model, "predict", SIG, 8)
    assert planner.failed(2) is True
    assert planner.next_size() == 1
    assert planner.failed(1) is False


def test_shrinking_never_goes_below_one(device, model):
    dev = device(stats=False, fail_above=1)
    planner = BatchPlanner(model, "predict", SIG, 7)
    log = drive(planner, dev, 5)
    assert min(s for s, _ in log) == 1
    assert all(s >= 1 for s, _ in log)


def test_oom_corrects_an_overoptimistic_estimate(device, model):
    # The probes see 1 MiB per sample; fragmentation makes 300+ fail anyway.
    dev = device(capacity=1000 * MiB, per_sample=MiB, fail_above=300)
    planner = BatchPlanner(model, "predict", SIG, 4096)
    attempt(planner, dev, 10_000)
    attempt(planner, dev, 10_000)
    estimate = planner.next_size()
    assert estimate > 300
    assert attempt(planner, dev, 10_000) == (estimate, False)
    assert planner.estimate() < estimate  # no longer predicted to fit
    assert planner.ceiling() < estimate
    assert planner.next_size() <= estimate // 2
    log = drive(planner, dev, 3000)
    assert all(s < estimate for s, _ in log)


def test_oom_with_only_stats_uses_the_observed_peak_as_limit(device, model):
    # No limit reported: the peak seen at the OOM bounds the free memory.
    dev = device(capacity=600 * MiB, report_limit=False, per_sample=MiB, fixed=0)
    planner = BatchPlanner(model, "predict", SIG, 4096)
    assert attempt(planner, dev, 10_000) == (4096, False)  # no probes first: no limit
    floor = knowledge_for(model, "predict", SIG).limit_floor
    assert floor == 600 * MiB
    # The pieces after the OOM measure memory, then size the rest.
    assert [attempt(planner, dev, 10_000) for _ in PROBE_SIZES] == [(16, True), (64, True)]
    after = planner.next_size()
    assert after <= 4096 // 2
    assert after <= planner.estimate(floor) < 4096
    assert dev.need(after) <= dev.capacity  # the corrected size fits
    assert attempt(planner, dev, 10_000) == (after, True)
    # Growth may probe once more (the limit is not known), then freezes.
    drive(planner, dev, 20_000)
    assert len(dev.ooms()) <= 2
    assert all(dev.fits(s) for s, _ in dev.attempts[-20:])


class HoldsFailedInput(FakeDevice):
    """A device whose limit nobody reported, failing as a GPU does on a batch far too large.

    The batch's input is placed on the device, then its first activation does
    not fit: the peak at the failure is the memory held before plus the input,
    and the failed piece's input stays held until the next piece runs (its
    traceback holds it).
    """

    def __init__(self, *, input_per_sample, **kwargs):
        super().__init__(report_limit=False, **kwargs)
        self.input_per_sample = input_per_sample
        self.held = 0

    def run(self, size):
        self.current -= self.held
        self.held = 0
        if self.fits(size):
            return super().run(size)
        self.held = size * self.input_per_sample
        self.current += self.held
        self.peak = max(self.peak, self.current)
        self.attempts.append((size, False))
        return False


def test_unknown_limit_pays_one_oom_then_stays_within_what_the_oom_proved(model, monkeypatch):
    dev = HoldsFailedInput(capacity=600 * MiB, per_sample=MiB, current=50 * MiB,
                           input_per_sample=16 * 1024)
    monkeypatch.setattr(backend_module, "get", lambda: dev)
    n = 20_000
    log = drive(BatchPlanner(model, "predict", SIG, n), dev, n)
    # One real try at the whole request (no probes first: no limit), which
    # fails; then the probes.
    assert dev.ooms() == [n], dev.ooms()
    assert log[1:3] == [(16, True), (64, True)]
    # That OOM proved the device holds the input it had placed: 20,000 samples
    # of 16 KiB over the 50 MiB held before. The pieces after it stay within
    # that (MARGIN of it at first): not one sample at a time, and no other OOM.
    proved = n * 16 * 1024
    after = [s for s, ok in log[3:]]
    assert proved * MARGIN // MiB / 2 <= after[0] <= proved * MARGIN // MiB
    assert max(after) <= proved // MiB
    assert sum(s for s, ok in log if ok) == n
    # The next call pays none.
    dev.attempts.clear()
    drive(BatchPlanner(model, "predict", SIG, n), dev, n)
    assert dev.ooms() == []


def test_shrink_when_memory_is_taken_mid_call(device, model):
    dev = device(capacity=1000 * MiB, per_sample=MiB)
    planner = BatchPlanner(model, "predict", SIG, 4096)
    drive(planner, dev, 1000)
    assert dev.ooms() == []
    dev.current = 900 * MiB  # another model moved in
    log = drive(planner, dev, 1000)
    assert sum(s for s, ok in log if ok) == 1000
    assert len(dev.ooms()) <= 2
    assert dev.need(log[-1][0]) <= dev.capacity


# --------------------------------------------------------------------------
# Growing back
# --------------------------------------------------------------------------
def test_growth_doubles_after_grow_after_successes_as_memory_frees(device, model, caplog):
    dev = device(capacity=1000 * MiB, current=900 * MiB, per_sample=MiB)
    events = []
    planner = BatchPlanner(model, "predict", SIG, 4096, events)
    attempt(planner, dev, 10_000)
    attempt(planner, dev, 10_000)
    start = planner.next_size()
    assert start < 100
    dev.current = 0  # memory freed elsewhere
    caplog.set_level(logging.INFO, logger="keras_memfit")
    for _ in range(GROW_AFTER - 1):
        assert attempt(planner, dev, 10_000) == (start, True)
    assert planner.next_size() == start  # not yet
    attempt(planner, dev, 10_000)
    assert planner.next_size() == 2 * start
    grow = [e for e in events if e.kind == "grow"]
    assert [(e.old_size, e.new_size) for e in grow] == [(start, 2 * start)]
    assert any(
        r.name == "keras_memfit" and r.levelno == logging.INFO
        and f"in a row fitted at batch_size={start}" in r.getMessage()
        for r in caplog.records
    )


def test_growth_stays_within_the_request_and_the_estimate(device, model):
    dev = device(capacity=1000 * MiB, current=880 * MiB, per_sample=MiB)
    planner = BatchPlanner(model, "predict", SIG, 300)
    attempt(planner, dev, 10_000)
    attempt(planner, dev, 10_000)
    assert planner.next_size() == 72  # 0.6 * 120 MiB free
    dev.current = 0
    log = drive(planner, dev, 20_000)
    sizes = [s for s, _ in log]
    assert max(sizes) == 300
    assert dev.ooms() == []
    # Sizes only ever grow here (no OOM), by at most doubling (the last piece
    # is clipped to what is left).
    for a, b in zip(sizes[2:-1], sizes[3:-1]):
        assert a <= b <= 2 * a


def test_growth_is_not_attempted_on_clipped_pieces(device, model):
    dev = device(stats=False, fail_above=100)
    planner = BatchPlanner(model, "predict", SIG, 1000)
    drive(planner, dev, 1000)
    size = planner.next_size()
    for _ in range(3 * GROW_AFTER):
        planner.started(size - 1)
        planner.succeeded(size - 1, full=False)
    assert planner.next_size() == size


def test_growth_bisects_towards_a_known_failure(device, model, caplog):
    caplog.set_level(logging.INFO, logger="keras_memfit")
    dev = device(stats=False, fail_above=450)
    events = []
    planner = BatchPlanner(model, "predict", SIG, 1000, events)
    log = drive(planner, dev, 20_000)
    k = knowledge_for(model, "predict", SIG)
    assert log[:3] == [(1000, False), (500, False), (250, True)]
    grows = [e for e in events if e.kind == "grow"]
    assert grows, "the planner never grew back"
    # The first growth goes half way to the ceiling (499), not to 500.
    assert (grows[0].old_size, grows[0].new_size) == (250, 250 + (499 - 250) // 2)
    for e in grows:
        assert e.new_size > e.old_size
        assert e.new_size <= 1000
    # Never tried a size at or above one that failed before it.
    failed = math.inf
    for size, ok in log:
        assert size < failed, f"tried {size} after {failed} had failed"
        if not ok:
            failed = min(failed, size)
    assert k.largest_ok <= 450
    assert k.smallest_failed > 450
    assert all(e.new_size < 500 for e in grows)


def test_failed_growth_freezes_at_the_largest_size_that_worked(device, model):
    dev = device(stats=False, fail_above=300)
    events = []
    planner = BatchPlanner(model, "predict", SIG, 1000, events)
    log = drive(planner, dev, 30_000)
    k = knowledge_for(model, "predict", SIG)
    assert k.growth_frozen
    assert k.largest_ok == 250
    assert planner.ceiling() == 250
    first_grow_fail = next(i for i, (s, ok) in enumerate(log) if not ok and s not in (1000, 500))
    assert log[first_grow_fail][0] == 374
    assert all(s <= 250 for s, _ in log[first_grow_fail + 1:])
    assert len(dev.ooms()) == 3  # 1000, 500 and the growth to 374; nothing after
    assert [e.kind for e in events].count("oom") == 3


def test_growth_never_exceeds_the_request(device, model):
    dev = device(stats=False, fail_above=90)
    planner = BatchPlanner(model, "predict", SIG, 100)
    log = drive(planner, dev, 10_000)
    assert max(s for s, _ in log) == 100
    assert all(s <= 100 for s, _ in log)
