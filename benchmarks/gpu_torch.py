"""The torch questions of `benchmarks.gpu`, each a scenario run in a child (`benchmarks.gpu_child`).

- "oom_forms": the forms torch's out-of-memory errors take (exception type,
  first line of the message, and whether keras_memfit's `is_oom_error`
  recognises it), met in four places: a plain allocation, a matrix product
  (cuBLAS on a GPU), a convolution (cuDNN and its workspace on a GPU), and
  Keras's `predict`. On the CPU, under an address-space limit, the same four
  places meet `DefaultCPUAllocator`'s error.
- "empty_cache": what `torch.cuda.empty_cache()` does between an OOM and the
  retry at a batch that fits: the caching allocator's reserved and
  allocated bytes after the OOM, the call's time, and the retry's time, with
  and without it, alternating (keras_memfit empties the cache after a failed
  step: `backend/torch/steps.AfterOOM`). Without CUDA the call does nothing
  and there are no statistics; the same code runs.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Optional

from benchmarks.gpu_common import data, error_form, model, outcome


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _cache_stats() -> Optional[Dict[str, int]]:
    """The caching allocator's reserved and allocated bytes (None without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return {"reserved": int(torch.cuda.memory_reserved()),
            "allocated": int(torch.cuda.memory_allocated())}


def _form_of(call: Callable[[], Any]) -> Optional[Dict[str, Any]]:
    """The error `call` raised, as `error_form` shows it (None if it raised nothing).

    Nothing of the exception is kept (its traceback holds the failed call's
    tensors), and the cache is emptied after it.
    """
    import torch

    try:
        call()
        form = None
    except Exception as err:  # noqa: BLE001 - the outcome being measured
        form = error_form(err)
    torch.cuda.empty_cache()
    return form


def oom_forms(kind: str, huge_bytes: int, rows: int) -> Dict[str, Any]:
    """The OOM forms of an allocation, a matmul and a convolution of `huge_bytes`, and a predict."""
    import torch
    import torch.nn.functional as F

    device = _device()
    floats = huge_bytes // 4
    side = int(floats ** 0.5)
    images = floats // (32 * 26 * 26)
    net = model(kind)
    x, _ = data(kind, rows)
    with torch.no_grad():
        forms = {
            "allocation": _form_of(lambda: torch.empty(floats, device=device)),
            "matmul": _form_of(lambda: torch.ones(side, 16, device=device)
                               @ torch.ones(16, side, device=device)),
            "convolution": _form_of(lambda: F.conv2d(
                torch.ones(images, 1, 28, 28, device=device),
                torch.ones(32, 1, 3, 3, device=device))),
            "keras predict": _form_of(lambda: net.predict(x, batch_size=rows, verbose=0)),
        }
    return {"device": device, "forms": forms}


def empty_cache(kind: str, fails: int, fits: int, rounds: int) -> Dict[str, Any]:
    """An OOM at `fails` rows, then the predict at `fits` rows, with and without emptying the cache."""
    import torch

    net = model(kind)
    x, _ = data(kind, fails)
    small = x[:fits]

    def retry():
        net.predict(small, batch_size=fits, verbose=0)
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    retry()  # warm
    runs = []
    for round_ in range(rounds):
        for clear in ((False, True) if round_ % 2 == 0 else (True, False)):
            failed = outcome(lambda: net.predict(x, batch_size=fails, verbose=0))
            after_oom = _cache_stats()
            start = time.perf_counter()
            if clear:
                torch.cuda.empty_cache()
            cleared_s = time.perf_counter() - start
            before_retry = _cache_stats()
            start = time.perf_counter()
            retried = outcome(retry)
            runs.append({"empty_cache": clear, "failed": failed, "after_oom": after_oom,
                         "empty_cache_s": cleared_s, "before_retry": before_retry,
                         "retry": retried, "retry_s": time.perf_counter() - start})
    return {"device": _device(), "runs": runs}


SCENARIOS = {"oom_forms": oom_forms, "empty_cache": empty_cache}
