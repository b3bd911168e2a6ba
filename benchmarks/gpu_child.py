"""The child side of `benchmarks.gpu`: one scenario in a fresh process, its memory shrunk first.

Run by the parent as `python -m benchmarks.gpu_child JSON`, with
`KERAS_BACKEND` set to "jax" or "torch". JSON holds the scenario's name, its
arguments, and the memory it may use (`memory_gb`, 0 for no limit), shrunk
here before the framework starts, which is why this module imports only the
standard library at its top:

- on a GPU under JAX: `XLA_PYTHON_CLIENT_MEM_FRACTION` (that many GiB of the
  device's `device_bytes`), set before jax is imported;
- on a GPU under torch: `torch.cuda.set_per_process_memory_fraction`, right
  after torch is imported;
- on the CPU (`--cpu-check`): an address-space limit (`RLIMIT_AS`) of
  `baseline_bytes` (what the framework, Keras and keras_memfit map, measured
  by the "probe" scenario) plus `memory_gb`. Under torch the limited child
  runs torch's native CPU kernels: oneDNN's sometimes fail first in an
  allocation of their own, with a message that is not an OOM form.

Matrix products and convolutions run at float32's full precision (no TF32
on a GPU: `full_precision`). The child prints one line `RESULT <json>`.
The scenarios every backend runs are here; the JAX and torch questions are
in `benchmarks.gpu_jax` and `benchmarks.gpu_torch`, what they share in
`benchmarks.gpu_common`.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from typing import Any, Callable, Dict, List

from benchmarks.gpu_common import (
    backend, data, error_form, forward_pass, free, model, outcome, surface,
)

GIB = 2**30


# ------------------------------------------------------------------ limits
def limit_memory(config: Dict[str, Any]) -> None:
    """Shrink the memory this process may use, before (JAX) or as (torch) the framework starts."""
    gib = config.get("memory_gb", 0)
    if not gib:
        return
    if config["platform"] == "cpu":
        cap = config["baseline_bytes"] + int(gib * GIB)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
        if backend() == "torch":
            import torch

            torch.backends.mkldnn.enabled = False  # see this module's docstring
    elif backend() == "jax":
        os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{gib * GIB / config['device_bytes']:.4f}"
    else:
        import torch

        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(gib * GIB / total)


def _timed(call: Callable[[], Any]):
    start = time.perf_counter()
    result = call()
    return time.perf_counter() - start, result


# --------------------------------------------------------------- scenarios
def seed(kind: str, rows: int, oracle_batch: int) -> Dict[str, Any]:
    """`safe_predict` at batch_size=rows, two calls, against the oracle and plain Keras."""
    import numpy as np

    import keras_memfit
    from benchmarks.jobs import OomCounter

    net = model(kind)
    x, _ = data(kind, rows)
    net.predict(x[:oracle_batch], batch_size=oracle_batch, verbose=0)  # compile
    oracle, expected = _timed(lambda: net.predict(x, batch_size=oracle_batch, verbose=0))
    calls = []
    for _ in range(2):
        with OomCounter() as counter:
            seconds, got = _timed(lambda: keras_memfit.safe_predict(
                net, x, batch_size=rows, verbose=0))
        calls.append([seconds, counter.count, float(np.abs(got - expected).max())])
        del got
    weights_ok = all(w is not None for w in net.get_weights())

    def plain():
        net.predict(x, batch_size=rows, verbose=0)
        surface(net)

    return {"oracle_s": oracle, "calls": calls, "weights_readable": weights_ok,
            "plain": outcome(plain)}


def fit(kind: str, rows: int, out: str, memfit: bool) -> Dict[str, Any]:
    """Two epochs at batch_size=rows: plain Keras (its outcome) then MemFit, or the unlimited fit.

    The final weights and optimizer variables go to `out` (.npz) for the
    parent's comparison.
    """
    import numpy as np

    import keras_memfit
    from benchmarks.jobs import OomCounter

    x, y = data(kind, rows)
    report: Dict[str, Any] = {}
    if memfit:  # under the limit: plain Keras first, on its own model
        doomed = model(kind)

        def plain():
            doomed.fit(x, y, batch_size=rows, epochs=1, shuffle=False, verbose=0)
            surface(doomed)

        report["plain"] = outcome(plain)
        del doomed
        free()
    net = model(kind)
    callbacks = [keras_memfit.MemFit()] if memfit else []
    net.fit(x[:64], y[:64], batch_size=64, epochs=1, verbose=0)  # compile, 1 step
    with OomCounter() as counter:
        seconds, history = _timed(lambda: net.fit(
            x, y, batch_size=rows, epochs=2, shuffle=False, verbose=0, callbacks=callbacks))
    report.update(seconds=seconds, ooms=counter.count,
                  split=history.history.get("memfit_split", [1]),
                  history={k: v for k, v in history.history.items()
                           if not k.startswith("memfit")},
                  iterations=int(net.optimizer.iterations.numpy()))
    state = net.get_weights() + [np.array(v.numpy()) for v in net.optimizer.variables]
    np.savez(out, *state)
    return report


def footprint(batch: int, widths: List[int], memfit: bool) -> Dict[str, Any]:
    """The widest `benchmarks.footprint_child.wide_model` whose fit of two batches completes.

    Widths are tried in increasing order in this one process, each on a new
    model after the last one's memory is freed, up to the first that fails.
    """
    import keras_memfit
    from benchmarks.footprint_child import wide_data, wide_model
    from benchmarks.jobs import OomCounter

    x, y = wide_data(2 * batch)
    tries = []
    for width in widths:
        with OomCounter() as counter:
            try:
                net = wide_model(width)
                net.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0,
                        callbacks=[keras_memfit.MemFit()] if memfit else [])
                surface(net)
            except Exception as err:  # noqa: BLE001 - the outcome being measured
                tries.append({"width": width, "ok": False, "error": error_form(err),
                              "ooms": counter.count})
                break
        tries.append({"width": width, "ok": True, "ooms": counter.count})
        del net
        free()
    return {"tries": tries}


def overhead(kind: str, rows: int, batch: int, repeats: int) -> Dict[str, Any]:
    """fit and predict with no memory pressure, MemFit/safe_predict against plain Keras, interleaved.

    One warm-up call of each path first (compilation); then `repeats` rounds,
    the order of the two paths alternating from round to round.
    """
    import keras_memfit

    x, y = data(kind, rows)
    nets = {"keras": model(kind), "memfit": model(kind)}
    calls = {
        ("fit", "keras"): lambda: nets["keras"].fit(
            x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0),
        ("fit", "memfit"): lambda: nets["memfit"].fit(
            x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0,
            callbacks=[keras_memfit.MemFit()]),
        ("predict", "keras"): lambda: nets["keras"].predict(x, batch_size=batch, verbose=0),
        ("predict", "memfit"): lambda: keras_memfit.safe_predict(
            nets["memfit"], x, batch_size=batch, verbose=0),
    }
    times: Dict[str, Dict[str, List[float]]] = {"fit": {"keras": [], "memfit": []},
                                                "predict": {"keras": [], "memfit": []}}
    for round_ in range(repeats + 1):  # round 0: the warm-up
        for call in ("fit", "predict"):
            order = ("keras", "memfit") if round_ % 2 == 0 else ("memfit", "keras")
            for path in order:
                seconds, _ = _timed(calls[(call, path)])
                surface(nets[path])
                if round_:
                    times[call][path].append(seconds)
    return {"times": times}


def oom_cost(kind: str, fails: int, fits: int, tries: int) -> Dict[str, Any]:
    """What one OOM costs: the time to the error, and the next call's extra time.

    Timed on the model's forward pass (`forward_pass`), which holds no Keras
    state: at `fits` rows warm; then, `tries` times, at `fails` rows to its
    OOM (the allocator's own retries and waits are in it; the first try also
    compiles the shape on JAX) and at once at `fits` rows again (what the
    failure left to clean up is in it). Then plain Keras's `predict` at
    `fails` rows and at `fits` rows: whether the model still predicts after
    its OOM (on JAX Keras writes the failed call's state back into it).
    """
    import statistics

    net = model(kind)
    x, _ = data(kind, fails)
    forward = forward_pass(net)

    def step():
        forward(x[:fits])

    step()
    steady = statistics.median(_timed(step)[0] for _ in range(3))
    rows = []
    for _ in range(tries):
        start = time.perf_counter()
        result = outcome(lambda: forward(x))
        to_error = time.perf_counter() - start
        start = time.perf_counter()
        after = outcome(step)
        rows.append({"outcome": result, "to_error_s": to_error, "next": after,
                     "next_s": time.perf_counter() - start})
    keras_oom = outcome(lambda: (net.predict(x, batch_size=fails, verbose=0), surface(net)))
    keras_next = outcome(lambda: (net.predict(x[:fits], batch_size=fits, verbose=0),
                                  surface(net)))
    return {"steady_s": steady, "tries": rows, "keras": [keras_oom, keras_next]}


def probe() -> Dict[str, Any]:
    """The platform, device and versions, and the address space a tiny fit and predict map."""
    import keras
    import numpy as np

    import keras_memfit

    # The scenarios seed their models, which imports TensorFlow where it is
    # installed (over 1 GiB of address space): part of the baseline too.
    keras.utils.set_random_seed(0)
    tiny = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    tiny.compile("adam", "mse")
    tiny.fit(np.ones((2, 1)), np.ones((2, 1)), verbose=0, callbacks=[keras_memfit.MemFit()])
    keras_memfit.safe_predict(tiny, np.ones((2, 1)), verbose=0)
    with open("/proc/self/status") as status:
        peak = next(int(line.split()[1]) * 1024 for line in status
                    if line.startswith("VmPeak"))
    info = {"baseline_bytes": peak, "keras": keras.__version__}
    if backend() == "jax":
        import jax

        device = jax.devices()[0]
        stats = device.memory_stats() or {}
        fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", 0.75))
        info.update(platform="cpu" if device.platform == "cpu" else "gpu",
                    device=device.device_kind, framework=f"jax {jax.__version__}",
                    device_bytes=int(stats["bytes_limit"] / fraction)
                    if "bytes_limit" in stats else 0)
    else:
        import torch

        cuda = torch.cuda.is_available()
        info.update(platform="gpu" if cuda else "cpu",
                    device=torch.cuda.get_device_name(0) if cuda else "cpu",
                    framework=f"torch {torch.__version__}",
                    device_bytes=torch.cuda.get_device_properties(0).total_memory if cuda else 0)
    return info


def scenarios() -> Dict[str, Callable[..., Dict[str, Any]]]:
    """Every scenario this child can run, by name (the backend's own questions included)."""
    common = {"probe": probe, "seed": seed, "fit": fit, "footprint": footprint,
              "overhead": overhead, "oom_cost": oom_cost}
    if backend() == "jax":
        from benchmarks import gpu_jax

        return dict(common, **gpu_jax.SCENARIOS)
    from benchmarks import gpu_torch

    return dict(common, **gpu_torch.SCENARIOS)


def full_precision() -> None:
    """float32 matrix products and convolutions without TF32, so that results compare at 1e-4."""
    if backend() == "jax":
        os.environ["JAX_DEFAULT_MATMUL_PRECISION"] = "highest"  # read when jax starts
        return
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def main(argv: List[str]) -> None:
    config = json.loads(argv[0])
    limit_memory(config)
    full_precision()
    result = scenarios()[config["scenario"]](**config.get("args", {}))
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
