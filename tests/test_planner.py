"""Unit tests of keras_memfit.planning.planner.BatchPlanner against a simulated device.

A fake backend (monkeypatched behind `keras_memfit.backend.get`) simulates a
device with a memory limit, memory already in use, and a fixed plus
per-sample cost for each batch, so that the planner's estimates, shrinking,
growth and memory can be checked exactly, without TensorFlow's allocator.
The end-to-end tests drive `runner.run_in_pieces` with a fake step raising
real `tf.errors.ResourceExhaustedError`s.
"""

from __future__ import annotations

import gc
import logging
import math
import weakref

import numpy as np
import pytest

from keras_memfit import backend as backend_module
from keras_memfit.planning import runner
from keras_memfit.oom import OutOfMemoryError
from keras_memfit.planning.planner import (
    GROW_AFTER,
    MARGIN,
    MIN_PROBE_REQUEST,
    PROBE_SIZES,
    BatchPlanner,
    forget,
    knowledge_for,
)
from support import oom_error, oom_error_class, runtime_error

ACTIVE_BACKEND = backend_module.get()  # before the `device` fixture replaces get()

MiB = 1 << 20
SIG = ((("4",), "float32"),)


@pytest.fixture(autouse=True)
def _probing_planner(monkeypatch):
    """These tests are of the probing planner (steps not compiled per shape);
    the XLA planner has its own (test_jax_compiles.py, test_tf_compiles.py)."""
    from support import backend_module

    monkeypatch.setattr(backend_module(), "compiles_per_shape", lambda model: False)


class FakeDevice:
    """A simulated accelerator, standing in for the keras_memfit backend module.

    Args:
        capacity: Bytes the device can hold (None: unlimited).
        report_limit: Whether `memory_limit` reports `capacity`.
        exact: The `exact` flag `memory_limit` reports.
        stats: Whether `memory_stats` reports (current, peak) or None.
        per_sample, fixed: A batch of n samples needs `fixed + n * per_sample`.
        current: Bytes held by other things on the device.
        fail_above: Batches above this size fail whatever the arithmetic says
            (fragmentation the planner cannot see).
    """

    def __init__(self, *, capacity=None, report_limit=True, exact=True, stats=True,
                 per_sample=MiB, fixed=0, current=0, fail_above=None):
        self.capacity = capacity
        self.report_limit = report_limit
        self.exact = exact
        self.stats = stats
        self.per_sample = per_sample
        self.fixed = fixed
        self.current = current
        self.peak = current
        self.fail_above = fail_above
        self.attempts = []  # (size, ok)
        self.resets = 0

    # The backend seam used by the planner.
    def compute_device(self):
        return "FAKE:0"

    def memory_stats(self, device):
        assert device == "FAKE:0"
        return (self.current, self.peak) if self.stats else None

    def memory_limit(self, device):
        assert device == "FAKE:0"
        if self.capacity is None or not self.report_limit:
            return None
        return (self.capacity, self.exact)

    def reset_peak(self, device):
        assert device == "FAKE:0"
        self.resets += 1
        self.peak = self.current

    # Everything else (OOM classification, OutOfMemoryError) is the active backend's.
    def __getattr__(self, name):
        return getattr(ACTIVE_BACKEND, name)

    # The simulation.
    def need(self, size):
        return self.current + self.fixed + self.per_sample * size

    def fits(self, size):
        if self.fail_above is not None and size > self.fail_above:
            return False
        return self.capacity is None or self.need(size) <= self.capacity

    def run(self, size):
        ok = self.fits(size)
        need = self.need(size)
        touched = need if (ok or self.capacity is None) else min(need, self.capacity)
        self.peak = max(self.peak, touched)
        self.attempts.append((size, ok))
        return ok

    def ooms(self):
        """Sizes of the attempts that ran out of memory, in order."""
        return [s for s, ok in self.attempts if not ok]


class Dummy:
    """A stand-in model: weak-referenceable, with a name."""

    def __init__(self, name="dummy"):
        self.name = name


@pytest.fixture
def device(monkeypatch):
    """Install a FakeDevice as the backend; configure it with `device(**kw)`."""
    holder = {}

    def make(**kwargs):
        dev = FakeDevice(**kwargs)
        holder["dev"] = dev
        return dev

    monkeypatch.setattr(backend_module, "get", lambda: holder["dev"])
    return make


@pytest.fixture
def model():
    return Dummy()


def attempt(planner, dev, remaining):
    """One try as run_in_pieces makes it: returns (size, ok)."""
    planned = planner.next_size()
    size = int(min(planned, remaining))
    planner.started(size)
    if dev.run(size):
        planner.succeeded(size, full=size >= planned)
        return size, True
    assert planner.failed(size), f"planner gave up at size {size}"
    return size, False


def drive(planner, dev, n):
    """Process n samples; returns the [(size, ok)] attempts."""
    done, log = 0, []
    while done < n:
        size, ok = attempt(planner, dev, n - done)
        log.append((size, ok))
        done += size if ok else 0
        assert len(log) < 10_000
    return log


def expected_estimate(dev):
    """What the probes should lead to: the budget over the fitted per-sample cost."""
    s1, s2 = PROBE_SIZES
    m1, m2 = dev.fixed + dev.per_sample * s1, dev.fixed + dev.per_sample * s2
    per_sample = max(m2 / s2, (m2 - m1) / (s2 - s1))
    return int((dev.capacity - dev.current) * MARGIN // per_sample)


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
    attempt(planner, dev, 10_000)
    attempt(planner, dev, 10_000)
    assert planner.next_size() == 4096


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
    attempt(planner, dev, 10_000)
    attempt(planner, dev, 10_000)
    assert planner.next_size() == 4096  # nothing to estimate against yet
    assert attempt(planner, dev, 10_000) == (4096, False)
    floor = knowledge_for(model, "predict", SIG).limit_floor
    assert floor == 600 * MiB
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
    # The probes, then one real try at the rest, which fails.
    assert dev.ooms() == [n - 16 - 64], dev.ooms()
    # That OOM proved the device holds the input it had placed: 19,920 samples
    # of 16 KiB over the 50 MiB held before. The pieces after it stay within
    # that (MARGIN of it at first): not one sample at a time, and no other OOM.
    proved = (n - 16 - 64) * 16 * 1024
    after = [s for s, ok in log[3:]]
    assert after[0] == int(proved * MARGIN // MiB)
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


# --------------------------------------------------------------------------
# Memory across calls
# --------------------------------------------------------------------------
def test_second_planner_starts_at_largest_ok_and_pays_no_oom(device, model):
    dev = device(stats=False, fail_above=300)
    drive(BatchPlanner(model, "evaluate", SIG, 1000), dev, 1000)
    assert dev.ooms()
    largest = knowledge_for(model, "evaluate", SIG).largest_ok
    dev.attempts.clear()
    events = []
    second = BatchPlanner(model, "evaluate", SIG, 1000, events)
    assert second.next_size() == largest
    log = drive(second, dev, 20 * GROW_AFTER * largest)
    assert dev.ooms() == []
    assert {s for s, _ in log} == {largest}  # never grows
    assert events == []


def test_second_planner_with_stats_skips_probes_after_an_oom(device, model):
    dev = device(capacity=1000 * MiB, per_sample=MiB, fail_above=300)
    drive(BatchPlanner(model, "predict", SIG, 4096), dev, 2000)
    assert dev.ooms()
    largest = knowledge_for(model, "predict", SIG).largest_ok
    assert largest <= 300
    dev.attempts.clear()
    second = BatchPlanner(model, "predict", SIG, 4096)
    assert second.next_size() == largest
    drive(second, dev, 5000)
    assert dev.ooms() == []


def test_second_planner_after_a_clean_call_starts_at_the_request(device, model):
    dev = device(stats=False)
    drive(BatchPlanner(model, "predict", SIG, 100), dev, 500)
    assert BatchPlanner(model, "predict", SIG, 100).next_size() == 100


@pytest.mark.parametrize(
    "phase, sig",
    [("predict", SIG), ("evaluate", ((("5",), "float32"),)), ("evaluate", ((("4",), "int32"),))],
    ids=["other-phase", "other-shape", "other-dtype"],
)
def test_knowledge_is_per_phase_and_signature(device, model, phase, sig):
    dev = device(stats=False, fail_above=300)
    drive(BatchPlanner(model, "evaluate", SIG, 1000), dev, 1000)
    assert BatchPlanner(model, "evaluate", SIG, 1000).next_size() == 250
    assert BatchPlanner(model, phase, sig, 1000).next_size() == 1000
    assert knowledge_for(model, phase, sig).smallest_failed is None


def test_knowledge_is_per_model(device, model):
    dev = device(stats=False, fail_above=300)
    drive(BatchPlanner(model, "predict", SIG, 1000), dev, 1000)
    assert BatchPlanner(Dummy("other"), "predict", SIG, 1000).next_size() == 1000


def test_forget_drops_the_knowledge(device, model):
    dev = device(stats=False, fail_above=300)
    drive(BatchPlanner(model, "predict", SIG, 1000), dev, 1000)
    forget(model)
    assert BatchPlanner(model, "predict", SIG, 1000).next_size() == 1000


def test_knowledge_does_not_keep_the_model_alive(device):
    dev = device(stats=False, fail_above=300)
    doomed = Dummy("doomed")
    drive(BatchPlanner(doomed, "predict", SIG, 1000), dev, 1000)
    ref = weakref.ref(doomed)
    del doomed
    gc.collect()
    assert ref() is None


# --------------------------------------------------------------------------
# Events and logs
# --------------------------------------------------------------------------
def test_oom_is_a_warning_event_and_log(device, model, caplog):
    caplog.set_level(logging.INFO, logger="keras_memfit")
    dev = device(stats=False, fail_above=400)
    events = []
    planner = BatchPlanner(model, "evaluate", SIG, 1000, events)
    attempt(planner, dev, 10_000)
    assert [(e.phase, e.kind, e.old_size, e.new_size) for e in events] == [
        ("evaluate", "oom", 1000, 500)
    ]
    warnings = [r for r in caplog.records
                if r.name == "keras_memfit" and r.levelno == logging.WARNING]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert "batch_size=1000" in message and "batch_size=500" in message
    assert "dummy" in message and "evaluate" in message


def test_estimate_is_an_info_event_and_log(device, model, caplog):
    caplog.set_level(logging.INFO, logger="keras_memfit")
    dev = device(capacity=1000 * MiB, per_sample=MiB)
    events = []
    planner = BatchPlanner(model, "predict", SIG, 4096, events)
    attempt(planner, dev, 10_000)
    attempt(planner, dev, 10_000)
    chosen = planner.next_size()
    assert [(e.kind, e.old_size, e.new_size) for e in events] == [("estimate", 4096, chosen)]
    infos = [r for r in caplog.records if r.name == "keras_memfit" and r.levelno == logging.INFO]
    assert len(infos) == 1
    assert f"batch_size={chosen}" in infos[0].getMessage()
    assert "4096" in infos[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_grow_is_an_info_event(device, model, caplog):
    caplog.set_level(logging.INFO, logger="keras_memfit")
    dev = device(stats=False, fail_above=300)
    events = []
    planner = BatchPlanner(model, "predict", SIG, 1000, events)
    drive(planner, dev, (GROW_AFTER + 2) * 250 + 1500)
    grows = [e for e in events if e.kind == "grow"]
    assert grows and (grows[0].old_size, grows[0].new_size) == (250, 374)
    grow_logs = [r for r in caplog.records
                 if r.levelno == logging.INFO and "batches in a row" in r.getMessage()]
    assert len(grow_logs) == len(grows)


def test_no_events_when_everything_fits(device, model, caplog):
    caplog.set_level(logging.DEBUG, logger="keras_memfit")
    dev = device(stats=False)
    events = []
    drive(BatchPlanner(model, "predict", SIG, 64, events), dev, 1000)
    assert events == []
    assert not [r for r in caplog.records if r.name == "keras_memfit"]


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


@pytest.mark.parametrize("stats", [False, True])
@pytest.mark.parametrize("requested", [1000, 37, None])
def test_run_in_pieces_processes_every_row_once_in_order(device, model, stats, requested):
    device(capacity=10_000 * MiB if stats else None, stats=stats)
    x = np.arange(2000)
    chunks = [(x[:700],), (x[700:710],), (x[710:1999],), (x[1999:],)]
    step = FakeStep(threshold=90, spikes={5, 11, 40, 41})
    events = []
    done = runner.run_in_pieces(
        model, "predict", chunks, step, step.on_piece, requested=requested,
        guard=step, events=events,
    )
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
    done = runner.run_in_pieces(model, "evaluate", batches, step, step.on_piece,
                                requested=None, guard=step)
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
    runner.run_in_pieces(model, "predict", [(x,)], first, first.on_piece, requested=256)
    assert first.rollbacks == 0 and len(first.calls) > len(first.seen)
    second = FakeStep(threshold=60)
    runner.run_in_pieces(model, "predict", [(x,)], second, second.on_piece,
                         requested=256, guard=second)
    assert len(second.calls) == len(second.seen)
    assert second.rollbacks == 0
    np.testing.assert_array_equal(np.concatenate(second.seen), x)


def test_run_in_pieces_stops_when_on_piece_says_so(device, model):
    device(stats=False)
    step = FakeStep()
    pieces = []

    def on_piece(size, piece, result):
        pieces.append(size)
        return len(pieces) == 3

    done = runner.run_in_pieces(model, "predict", [(np.arange(100),)], step, on_piece,
                                requested=10)
    assert done == 30
    assert step.calls == [10, 10, 10]


def test_run_in_pieces_propagates_other_errors_untouched(device, model):
    device(stats=False)
    error = runtime_error("bad shape")
    guard = FakeStep()

    def step(piece):
        raise error

    with pytest.raises(type(error)) as info:
        runner.run_in_pieces(model, "predict", [(np.arange(10),)], step,
                             lambda *a: False, requested=4,
                             guard=guard)
    assert info.value is error
    assert guard.rollbacks == 0


def test_run_in_pieces_single_sample_oom_raises_out_of_memory_error(device, model):
    device(stats=False)
    step = FakeStep(threshold=0)
    with pytest.raises(OutOfMemoryError) as info:
        runner.run_in_pieces(model, "evaluate", [(np.arange(10.0).reshape(5, 2),)], step,
                             step.on_piece, requested=4, guard=step)
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

    runner.run_in_pieces(model, "predict", [wide[0], narrow[0], wide[1], narrow[1]], step,
                         lambda *a: False, requested=40)
    narrow_calls = [s[0] for s in calls if s[1] == 2]
    assert narrow_calls == [40, 40]
    wide_calls = [s[0] for s in calls if s[1] == 8]
    assert wide_calls[:3] == [40, 20, 10]
    assert max(wide_calls[3:]) <= 10
