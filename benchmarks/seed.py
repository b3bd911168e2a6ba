"""The seed scenario: 28,000 digit images under a cap where a few hundred fit.

Time to the finished predictions, and OOMs paid, for what users do today
against `safe_predict`, each approach in a fresh process under the capped CPU
allocator (the demo's 400 MiB; the CNN is the demo's `build_cnn`, the inputs
its generated Kaggle-shaped test digits, scaled to 0..1):

- "manual split": the seed notebook's loop, `np.split(x, k)` and one
  `model.predict(part, batch_size=len(part))` per part, with split counts a
  user would guess: 10 first, then 100 after an OOM;
- "halving": `model.predict(x, batch_size=b)`, halving `b` after each OOM;
- "0.9 decay": the same with `b = int(0.9 * b)` (Accelerate's
  `find_executable_batch_size` default);
- "power-of-two finder": Lightning's `scale_batch_size(mode="power")`: 3
  predict steps at 2, 4, 8, ... until an OOM (or the data size), then
  `model.predict(x, batch_size=largest that worked)`;
- "safe_predict (1st call)" / "(2nd call)": `safe_predict(model, x,
  batch_size=28000)` twice in one process, each call timed;
- "oracle": `model.predict(x, batch_size=B)` with B the largest batch found to
  fit beforehand (bisection in a separate process, not timed).

Every timed region starts at the user's call and ends when the predictions
exist (an OOM's ~10 s wait and the `gc.collect()` that frees the failed call's
memory are inside it). Every approach's predictions are checked against the
oracle's.
"""

from __future__ import annotations

import gc
import os
import re
import time
from typing import Any, Dict, List, Optional

import numpy as np

APPROACHES = ("manual_split", "halving", "decay", "finder", "safe", "oracle")
LABELS = {
    "manual_split": "manual np.split (10, then 100 parts)",
    "halving": "retry, halving the batch",
    "decay": "retry, batch x 0.9 (Accelerate default)",
    "finder": "power-of-two finder, then run (Lightning)",
    "safe": "safe_predict, 1st call",
    "safe_second": "safe_predict, 2nd call",
    "oracle": "oracle: model.predict at the largest batch that fits",
}
# The approaches that hand the whole input to one `model.predict` call (which then
# holds all of it on the device, whatever the batch size); the manual split and
# safe_predict slice the input themselves.
WHOLE_INPUT = ("halving", "decay", "finder", "oracle")
PROBE_BATCH = 32  # the small batch `probe_job` tries at a sample count that may not fit
SPLIT_GUESSES = (10, 100)
FINDER_STEPS_PER_TRIAL = 3


# --------------------------------------------------------------------------
# Data (parent side: numpy only, no TensorFlow)
# --------------------------------------------------------------------------
def digits_path(workdir: str, n: int) -> str:
    """A cached .npy of `n` generated test digits, float32 [n, 28, 28, 1] in 0..1."""
    path = os.path.join(workdir, f"digits_test_{n}.npy")
    if not os.path.exists(path):
        from keras_memfit.app import digits

        _, _, x = digits.load_digits(0, n, seed=0)
        np.save(path, (x[..., None] / 255.0).astype("float32"))
    return path


# --------------------------------------------------------------------------
# Child side
# --------------------------------------------------------------------------
def _model():
    import keras

    from keras_memfit.app.demo import build_cnn

    keras.utils.set_random_seed(0)
    return build_cnn()


def _predict(model, x, batch_size: int, **kwargs) -> Optional[np.ndarray]:
    """`model.predict`, or None when it ran out of memory (memory then freed)."""
    from keras_memfit import is_oom_error

    try:
        return model.predict(x, batch_size=int(batch_size), verbose=0, **kwargs)
    except Exception as exc:  # noqa: BLE001 - only OOMs are swallowed
        if not is_oom_error(exc):
            raise
    gc.collect()  # what the failed call held (its tf.data pipeline, the input copy)
    return None


def _manual_split(model, x, config) -> Dict[str, Any]:
    ooms = 0
    for k in config.get("split_guesses", SPLIT_GUESSES):
        parts = []
        for part in np.array_split(x, k):
            y = _predict(model, part, len(part))
            if y is None:
                ooms += 1
                break
            parts.append(y)
        else:
            return dict(preds=np.concatenate(parts), ooms=ooms, batch_size=-(-len(x) // k))
    raise RuntimeError(f"no split count in {config.get('split_guesses')} fitted")


def _retry(model, x, config, shrink) -> Dict[str, Any]:
    b, ooms = int(config["requested"]), 0
    while True:
        y = _predict(model, x, b)
        if y is not None:
            return dict(preds=y, ooms=ooms, batch_size=b)
        ooms += 1
        if b == 1:
            raise RuntimeError("a batch of one sample does not fit")
        b = max(1, shrink(b))


def _finder(model, x, config) -> Dict[str, Any]:
    b, ooms, n = 2, 0, len(x)
    while True:
        trial = x[: FINDER_STEPS_PER_TRIAL * b]
        if _predict(model, trial, b) is None:
            ooms += 1
            b //= 2
            break
        if b >= n:
            break
        b = min(2 * b, n)
    # Running the whole set holds more (its input copy) than the trials did.
    result = _retry(model, x, dict(config, requested=b), lambda s: s // 2)
    result["ooms"] += ooms
    return result


def _safe(model, x, config) -> Dict[str, Any]:
    import keras

    from benchmarks.jobs import OomCounter
    from keras_memfit import safe_predict
    from keras_memfit.app.records import usual_size

    sizes: List[int] = []

    class Sizes(keras.callbacks.Callback):
        def on_predict_batch_end(self, batch, logs=None):
            sizes.append(len(logs["outputs"]))

    with OomCounter() as counter:
        start, cpu = time.perf_counter(), time.process_time()
        y = safe_predict(model, x, batch_size=int(config["requested"]), verbose=0,
                         callbacks=[Sizes()])
        first, first_cpu = time.perf_counter() - start, time.process_time() - cpu
    first_ooms, first_sizes = counter.count, list(sizes)
    gc.collect()
    sizes.clear()
    with OomCounter() as counter:
        start, cpu = time.perf_counter(), time.process_time()
        y2 = safe_predict(model, x, batch_size=int(config["requested"]), verbose=0,
                          callbacks=[Sizes()])
        second, second_cpu = time.perf_counter() - start, time.process_time() - cpu
    np.testing.assert_allclose(y, y2, rtol=1e-4, atol=1e-6)
    return dict(
        preds=y, ooms=first_ooms, batch_size=usual_size(first_sizes),
        first_seconds=first, first_cpu_seconds=first_cpu,
        first_sizes=first_sizes[:4], second_seconds=second, second_cpu_seconds=second_cpu,
        second_ooms=counter.count,
        second_batch_size=usual_size(sizes),
    )


def job(config: Dict[str, Any], say: Any = None) -> Dict[str, Any]:
    """One approach on the first `n` digits; returns seconds, OOMs, batch size.

    config: approach, data_path, n, requested, oracle_batch, preds_path (optional).
    """
    x = np.load(config["data_path"])[: int(config["n"])]
    model = _model()
    approach = config["approach"]
    runners = {
        "manual_split": _manual_split,
        "halving": lambda m, x, c: _retry(m, x, c, lambda b: b // 2),
        "decay": lambda m, x, c: _retry(m, x, c, lambda b: int(b * 0.9)),
        "finder": _finder,
        "safe": _safe,
        "oracle": lambda m, x, c: _retry(m, x, dict(c, requested=c["oracle_batch"]),
                                         lambda b: b // 2),
    }
    gc.collect()
    start, cpu = time.perf_counter(), time.process_time()
    result = runners[approach](model, x, config)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    if "first_seconds" in result:  # safe_predict: its first call alone (a second follows)
        seconds, cpu_seconds = result.pop("first_seconds"), result.pop("first_cpu_seconds")
    preds = result.pop("preds")
    if preds.shape != (len(x), 10):
        raise AssertionError(f"{approach}: predictions of shape {preds.shape}")
    if config.get("reference_path") and os.path.exists(config["reference_path"]):
        reference = np.load(config["reference_path"])[: len(x)]
        np.testing.assert_allclose(preds, reference, rtol=1e-3, atol=1e-5)
        result["checked"] = True
    elif config.get("reference_path"):
        np.save(config["reference_path"], preds)
    return dict(result, approach=approach, seconds=seconds, cpu_seconds=cpu_seconds, n=len(x))


def try_job(config: Dict[str, Any], say: Any = None) -> Dict[str, Any]:
    """Whether `model.predict(x, batch_size=config["batch_size"])` runs (fresh process)."""
    x = np.load(config["data_path"])[: int(config["n"])]
    model = _model()
    start = time.perf_counter()
    ok = _predict(model, x, int(config["batch_size"])) is not None
    return dict(ok=ok, seconds=time.perf_counter() - start)


def probe_job(config: Dict[str, Any], say: Any = None) -> Dict[str, Any]:
    """One `model.predict(x, batch_size=config["batch_size"])` call; its outcome, not its output.

    For sample counts where the whole input may not fit beside a batch (the
    scaling scenario's 100,000 digits under 400 MiB): a small batch shows
    whether `model.predict` can run at all. An OOM is recorded (type, first
    lines of the message, seconds until it was raised); any other error raises.
    """
    from keras_memfit import is_oom_error

    x = np.load(config["data_path"])[: int(config["n"])]
    model = _model()
    gc.collect()
    start = time.perf_counter()
    try:
        model.predict(x, batch_size=int(config["batch_size"]), verbose=0)
    except Exception as exc:  # noqa: BLE001 - only OOMs are recorded
        if not is_oom_error(exc):
            raise
        message = " ".join(str(exc).split())
        match = re.search(r"OOM when allocating tensor[^\n]*?(?= by allocator|$)", message)
        return dict(ok=False, n=len(x), batch_size=int(config["batch_size"]),
                    seconds=time.perf_counter() - start, error=type(exc).__name__,
                    detail=match.group(0) if match else message[:300])
    return dict(ok=True, n=len(x), batch_size=int(config["batch_size"]),
                seconds=time.perf_counter() - start)


def calibrate(run_try, n: int, start: int = 512, precision: float = 0.05,
              confirm: int = 0) -> Dict[str, Any]:
    """The largest batch the whole `model.predict` call runs with, by bisection.

    Args:
        run_try: Called with a batch size; returns whether the whole call,
            in a fresh process under the cap, ran (see `try_job`). Every try
            is the call the oracle will make: two steps on the whole input
            were measured to fit at 992 where the whole call failed at 992
            (the input pipeline prefetches, outputs pile up).
        n: Number of samples.
        start: First size tried; it doubles until a failure, then bisects.
        precision: Stop when the gap is within this share of the largest fit.
        confirm: Tries the result must then pass again (stepping down 5% on a failure).

    Returns:
        dict(oracle_batch=largest that ran, smallest_failed=..., tries=[(size, ok)]).
    """
    lo, hi, b = 0, None, start
    tries = []
    while True:
        ok = bool(run_try(b))
        tries.append((b, ok))
        if ok:
            lo = b
        else:
            hi = b
        if hi is None:
            if b >= n:
                break
            b = min(2 * b, n)
            continue
        if lo == 0:
            if b <= 1:
                break
            b //= 2
            continue
        if hi - lo <= max(8, precision * lo):
            break
        b = (lo + hi) // 2
    if lo == 0:
        raise RuntimeError(f"no batch size fitted; tried {tries}")
    # Near the limit, fitting is not deterministic (a first run measured 992 to fit,
    # then 3 of 5 oracle runs at 992 failed): the oracle's batch must fit every time
    # it is tried `confirm` more times, else it steps down by 5%.
    for _ in range(8):
        confirmed = True
        for _ in range(confirm):
            ok = bool(run_try(lo))
            tries.append((lo, ok))
            if not ok:
                confirmed = False
                break
        if confirmed:
            break
        hi = lo if hi is None else min(hi, lo)
        lo = max(1, int(lo * 0.95))
    return dict(oracle_batch=lo, smallest_failed=hi, tries=tries)
