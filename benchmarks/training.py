"""Training under the cap: time to finish N epochs, and the final loss.

The demo's CNN on generated digits (`shuffle=False`, the same initial weights
everywhere), `batch_size` larger than what fits under the cap, each approach
in a fresh process:

- "MemFit()": `fit(..., callbacks=[MemFit()])`: the batch that does not fit
  runs as accumulated micro-batches, one optimizer step per batch;
- "MemFit(mode='shrink')": the pieces run as separate optimizer steps;
- "restart, halving": what users do today: `fit` fails, `batch_size` is
  halved and `fit` is called again, until it finishes;
- "uncapped": plain `fit` at the requested batch with a cap large enough for
  it (16 GiB): the reference the final loss is compared against.

The loss compared is the model's loss on the whole training set after
training (`safe_evaluate`, not timed), besides the last epoch's logged loss.
"""

from __future__ import annotations

import gc
import os
import time
from typing import Any, Dict

import numpy as np

APPROACHES = ("uncapped", "memfit", "shrink", "restart")
LABELS = {
    "uncapped": "plain fit, uncapped (reference)",
    "memfit": "MemFit()",
    "shrink": "MemFit(mode='shrink')",
    "restart": "restart fit, halving batch_size",
}
UNCAPPED_MB = 16384


def data_path(workdir: str, n: int) -> str:
    """A cached .npz of `n` generated training digits (x float32 0..1, y int32)."""
    path = os.path.join(workdir, f"digits_train_{n}.npz")
    if not os.path.exists(path):
        from keras_memfit.app import digits

        x, y, _ = digits.load_digits(n, 0, seed=1)
        np.savez(path, x=(x[..., None] / 255.0).astype("float32"), y=y.astype("int32"))
    return path


def job(config: Dict[str, Any], say: Any = None) -> Dict[str, Any]:
    """One approach; returns seconds, OOMs, steps and final losses."""
    import keras

    from keras_memfit import MemFit, is_oom_error, safe_evaluate
    from keras_memfit.app.demo import build_cnn

    with np.load(config["data_path"]) as data:
        x, y = data["x"][: config["n"]], data["y"][: config["n"]]
    keras.utils.set_random_seed(0)
    model = build_cnn()
    approach, batch, epochs = config["approach"], int(config["batch_size"]), int(config["epochs"])
    ooms, memfit = 0, None
    gc.collect()
    start, cpu = time.perf_counter(), time.process_time()
    if approach in ("uncapped", "restart"):
        b = batch
        while True:
            try:
                history = model.fit(x, y, batch_size=b, epochs=epochs, shuffle=False, verbose=0)
                break
            except Exception as exc:  # noqa: BLE001 - only OOMs are retried
                if approach == "uncapped" or not is_oom_error(exc):
                    raise
            ooms += 1
            gc.collect()
            b //= 2
            if b < 1:
                raise RuntimeError("a batch of one sample does not fit")
    else:
        memfit = MemFit() if approach == "memfit" else MemFit(mode="shrink")
        history = model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0,
                            callbacks=[memfit])
        ooms = sum(1 for e in memfit.events if e["kind"] == "oom")
        b = batch
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    steps = int(model.optimizer.iterations.numpy())
    loss = safe_evaluate(model, x, y, batch_size=256, verbose=0)[0]
    result = dict(
        approach=approach, seconds=seconds, cpu_seconds=cpu_seconds, ooms=ooms, batch_size=b,
        optimizer_steps=steps,
        last_epoch_loss=float(history.history["loss"][-1]), final_loss=float(loss),
        n=len(x), epochs=epochs,
    )
    if memfit is not None:
        splits = history.history.get("memfit_split")
        result["split"] = int(max(splits)) if splits else 1
        result["events"] = [
            {k: e[k] for k in ("epoch", "step", "kind", "old_size", "new_size")}
            for e in memfit.events[:6]
        ]
    return result
