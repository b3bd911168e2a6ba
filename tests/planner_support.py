"""The simulated device and stand-in model the planner's tests run against.

A fake backend (monkeypatched behind `keras_memfit.backend.get` by the
`device` fixture) simulates a device with a memory limit, memory already in
use, and a fixed plus per-sample cost for each batch, so that the planner's
estimates, shrinking, growth and memory can be checked exactly, without
TensorFlow's allocator. Test modules import the fixtures (`device`, `model`)
with the helpers.
"""

from __future__ import annotations

import pytest

from keras_memfit import backend as backend_module
from keras_memfit.planning.planner import MARGIN, PROBE_SIZES

ACTIVE_BACKEND = backend_module.get()  # before the `device` fixture replaces get()

MiB = 1 << 20
SIG = ((("4",), "float32"),)




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


class NoStatisticsBackend:
    """The planner's part of the backend seam: one device, nothing known about memory.

    Args:
        multiple: What piece sizes must be a multiple of (`piece_multiple`).
        compiles: Whether steps compile once per input shape (`compiles_per_shape`).
    """

    def __init__(self, multiple=1, compiles=False):
        self.multiple = multiple
        self.compiles = compiles

    def compute_device(self):
        return "FAKE:0"

    def memory_stats(self, device):
        return None

    def memory_limit(self, device):
        return None

    def reset_peak(self, device):
        pass

    def piece_multiple(self):
        return self.multiple

    def replica_devices(self, model):
        return ()

    def compiles_per_shape(self, model):
        return self.compiles
