"""Host memory: peak resident memory added while predicting a large output.

A one-layer model (8 inputs -> Dense(1000), float32) on 200,000 rows, so the
full output is 200,000 x 1,000 float32 (800 MB), each approach in a fresh
process with no allocator cap (this is about host RAM, not device memory):

- "model.predict": Keras collects every batch's outputs, then concatenates;
- "safe_predict": outputs copied into one preallocated array;
- "safe_predict(postprocess=argmax)": only the labels (int64) leave the step;
- "safe_predict(out=np.memmap)": outputs written into a file-backed array.

Measured: the process's anonymous resident memory (`/proc/self/statm`
resident minus shared pages), sampled every millisecond by a thread, minus a
baseline taken after the model was built, the input created and the same
call run once on 4,096 rows (tracing and first-call allocations). File-backed
pages of the memmap are page cache the kernel can write back and drop, so
they are not counted; `VmHWM` (peak resident, file pages included, reset
through `/proc/self/clear_refs`) is reported alongside. Both are reported
relative to the full output's size.
"""

from __future__ import annotations

import gc
import os
import tempfile
import threading
import time
from typing import Any, Dict, Optional

import numpy as np

from benchmarks.common import HOSTMEM_TARGET_SHARE

APPROACHES = ("predict", "safe", "safe_argmax", "safe_memmap")
LABELS = {
    "predict": "model.predict",
    "safe": "safe_predict",
    "safe_argmax": "safe_predict(postprocess=argmax)",
    "safe_memmap": "safe_predict(out=np.memmap)",
}
TARGETED = ("safe_argmax", "safe_memmap")
TARGET_SHARE = HOSTMEM_TARGET_SHARE
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def anon_rss() -> int:
    """Anonymous resident bytes of this process (statm: resident - shared)."""
    with open("/proc/self/statm") as f:
        fields = f.read().split()
    return (int(fields[1]) - int(fields[2])) * _PAGE


def _hwm() -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakSampler:
    """Samples `anon_rss()` in a thread; `peak` is the largest value seen."""

    def __init__(self, interval: float = 0.001) -> None:
        self.interval = interval
        self.peak = anon_rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, anon_rss())
            time.sleep(self.interval)

    def __enter__(self) -> "PeakSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, anon_rss())


def job(config: Dict[str, Any], say: Any = None) -> Dict[str, Any]:
    """One approach; returns the added peak memory in bytes and as a share of the output."""
    import keras

    from keras_memfit import safe_predict

    n, width, batch = int(config["n"]), int(config["width"]), int(config["batch_size"])
    approach = config["approach"]
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(width)])
    x = np.random.default_rng(0).standard_normal((n, 8), dtype=np.float32)
    tmp = tempfile.mkdtemp(prefix="memfit-hostmem-")

    def argmax(y):
        return keras.ops.argmax(y, axis=-1)

    def call(rows: int, tag: str) -> Any:
        xs = x[:rows]
        if approach == "predict":
            return model.predict(xs, batch_size=batch, verbose=0)
        if approach == "safe":
            return safe_predict(model, xs, batch_size=batch, verbose=0)
        if approach == "safe_argmax":
            return safe_predict(model, xs, batch_size=batch, verbose=0, postprocess=argmax)
        out = np.memmap(os.path.join(tmp, f"{tag}.dat"), dtype="float32", mode="w+",
                        shape=(rows, width))
        return safe_predict(model, xs, batch_size=batch, verbose=0, out=out)

    warm = call(4096, "warm")
    check = model(x[:4096]).numpy()
    expected = check.argmax(-1) if approach == "safe_argmax" else check
    np.testing.assert_allclose(np.asarray(warm), expected, rtol=1e-4, atol=1e-5)
    del warm, check, expected
    gc.collect()
    baseline = anon_rss()
    hwm_reset = _reset_hwm()
    hwm_baseline = _hwm()
    start = time.perf_counter()
    with PeakSampler() as sampler:
        result = call(n, "full")
    seconds = time.perf_counter() - start
    hwm = _hwm()
    rows = len(result)
    del result
    output_bytes = n * width * 4
    added = sampler.peak - baseline
    hwm_added = (hwm - hwm_baseline) if (hwm_reset and hwm and hwm_baseline) else None
    for name in os.listdir(tmp):
        os.remove(os.path.join(tmp, name))
    os.rmdir(tmp)
    return dict(
        approach=approach, n=n, width=width, rows=rows, output_bytes=output_bytes,
        baseline_bytes=baseline, added_bytes=added, added_share=added / output_bytes,
        hwm_added_bytes=hwm_added,
        hwm_added_share=None if hwm_added is None else hwm_added / output_bytes,
        seconds=seconds,
    )
