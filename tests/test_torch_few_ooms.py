"""Under torch on the CPU, the seed's predict pays at most 2 OOMs (issue 38, item 5).

The CPU check's stand-in for the seed (`benchmarks/gpu.py --cpu-check`:
Dense(16384, relu) > Dense(10, softmax) on 8 features, whose full-batch
predict of 32,768 rows needs 2 GiB for the hidden layer alone) runs in a
child under an address-space limit 2 GiB above what importing torch maps
(`tests/torch_support.py`), at the CPU check's 32,768 rows and at twice
that. keras_memfit reads the limit (`RLIMIT_AS`) and the process's address
space as the CPU's memory (`backend/torch/memory.py`), so the planner sizes
the pieces from small probes instead of halving after each OOM (which paid
2 or 3 OOMs at 32,768 rows and 3 at 65,536). The first call pays at most
2 OOMs, the second none, and both equal plain Keras at a batch that fits.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.jax_support import OOMCounter
from tests.torch_support import requires_torch, run_in_torch

pytestmark = requires_torch

HEADROOM_GB = 2.0
ORACLE_BATCH = 2048


def _model():
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(16384, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])
    model.compile("adam", "sparse_categorical_crossentropy")
    return model


def child_seed_predict():
    import keras_memfit

    rows = int(os.environ["MEMFIT_ROWS"])
    model = _model()
    x = np.random.default_rng(0).random((rows, 8), dtype=np.float32)
    expected = model.predict(x, batch_size=ORACLE_BATCH, verbose=0)
    counts = []
    for _ in range(2):
        ooms = OOMCounter("out of memory at batch_size=")
        result = keras_memfit.safe_predict(model, x, batch_size=rows, verbose=0)
        np.testing.assert_allclose(result, expected, rtol=1e-5, atol=1e-6)
        counts.append(ooms.count)
        del result
    print(f"seed predict at {rows} rows: {counts[0]} OOMs, then {counts[1]}")
    assert counts[0] <= 2 and counts[1] == 0, counts
    try:  # the full batch does not fit: the call had to adapt
        model.predict(x, batch_size=rows, verbose=0)
    except RuntimeError as err:
        assert keras_memfit.is_oom_error(err), str(err)[:300]
    else:
        raise AssertionError("plain predict at the full batch fitted: the limit is too high")


def child_cpu_memory():
    """What the planner reads on the CPU: the limit, the address space, a piece's peak."""
    import resource

    import torch

    from keras_memfit.backend.torch import memory

    device = memory.compute_device()
    assert device == "cpu:0"
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    assert memory.memory_limit(device) == (soft, True)
    memory.reset_peak(device)
    before, _ = memory.memory_stats(device)
    size = 256 << 20
    block = torch.ones(size // 4)  # written: resident
    current, peak = memory.memory_stats(device)
    assert current >= before + size and peak >= current
    del block
    current, peak_after = memory.memory_stats(device)
    assert current < before + size <= peak_after  # freed, the peak stays
    # A piece reusing heap memory an earlier one freed counts in full: glibc
    # keeps a freed block below its mmap threshold (raised by the 16 MiB
    # block's free) in the heap, here below a live one (measured: 0 MiB of
    # growth without `malloc_trim`).
    block = torch.ones(16 << 18)
    del block
    block = torch.ones(8 << 18)
    pin = torch.ones(1024)
    del block
    memory.reset_peak(device)
    before, _ = memory.memory_stats(device)
    block = torch.ones(8 << 18)
    assert memory.memory_stats(device)[1] - before >= 8 << 20
    del block, pin


def child_cpu_memory_without_a_limit():
    from keras_memfit.backend.torch import memory

    device = memory.compute_device()
    memory.reset_peak(device)
    assert memory.memory_limit(device) is None and memory.memory_stats(device) is None


def test_the_cpu_reports_its_address_space_under_a_limit_and_nothing_without():
    run_in_torch(__file__, "child_cpu_memory", headroom_gb=HEADROOM_GB)
    run_in_torch(__file__, "child_cpu_memory_without_a_limit")


@pytest.mark.parametrize("rows", [32768, 65536])
def test_the_seed_predict_pays_at_most_two_ooms(rows):
    output = run_in_torch(__file__, "child_seed_predict", headroom_gb=HEADROOM_GB,
                          env={"MEMFIT_ROWS": str(rows)})
    print(next(line for line in output.splitlines() if line.startswith("seed predict")))
