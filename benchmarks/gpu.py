"""keras_memfit on JAX with less memory than the batch needs: a GPU check in one script.

Run on a machine with JAX (a GPU if there is one; TensorFlow not needed):

    python -m benchmarks.gpu [--memory-gb G] [--results benchmarks/RESULTS.md]

Every scenario runs in a fresh child process with `KERAS_BACKEND=jax` and
the usable memory shrunk before jax starts: on a GPU with
`XLA_PYTHON_CLIENT_MEM_FRACTION` (G GiB of the device), on the CPU with an
address-space limit (`RLIMIT_AS`, G GiB of address space; JAX's CPU client
has no capped allocator). The scenarios:

- seed: `model.predict(x, batch_size=len(x))` (fails), against
  `safe_predict(model, x, batch_size=len(x))`, first and second call: time,
  OOMs paid, and the largest difference from the oracle, `model.predict` at
  a batch known to fit (timed after a warm-up, as safe_predict's second call).
- fit: `model.fit(x, y, batch_size=len(x))` (fails) against the same fit
  with `callbacks=[MemFit()]`, compared with the fit run without the limit
  (weights, optimizer variables, iterations, History).

On a GPU the model is the seed CNN (Conv2D 32 > Conv2D 64 > MaxPool > Dense
10) on 28,000 generated digits; on the CPU, where XLA's convolutions hardly
allocate, a memory-heavy Dense(16384) model (as in tests/test_jax_real_oom.py).
It writes the `gpu-jax` section of RESULTS.md and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict

import numpy as np

from benchmarks import common

KEY = "gpu-jax"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 2**30
# platform -> (memory GiB, predict rows, oracle batch, fit rows)
SETTINGS = {"gpu": (2.0, 28000, 1024, 8192), "cpu": (5.0, 65536, 4096, 32768)}


# ----------------------------------------------------------------- children
def _model(platform: str):
    import keras

    keras.utils.set_random_seed(0)
    if platform != "cpu":
        from keras_memfit.app.demo import build_cnn

        return build_cnn()  # the seed's Kaggle CNN
    model = keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(16384, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def _data(platform: str, rows: int):
    if platform == "cpu":
        rng = np.random.default_rng(0)
        return rng.random((rows, 8), dtype=np.float32), rng.integers(0, 10, rows)
    from keras_memfit.app.digits import generate_digits

    images, labels = generate_digits(rows, seed=0)
    return (images[..., None] / np.float32(255)).astype("float32"), labels


class _Count:
    """Counts keras_memfit's "out of memory" warnings."""

    def __init__(self) -> None:
        import logging

        self.ooms = 0
        counter = self

        class Handler(logging.Handler):
            def emit(self, record):
                counter.ooms += "out of memory" in record.getMessage()

        logging.getLogger("keras_memfit").addHandler(Handler(logging.WARNING))


def _plain_fails(call) -> str:
    """Run plain Keras at the full batch: "OOM" (raised, or the model lost) or "fits"."""
    from keras_memfit import is_oom_error

    try:
        call()
    except Exception as err:  # noqa: BLE001 - reported, not handled
        return "OOM" if is_oom_error(err) else f"{type(err).__name__}"
    return "fits"


def child_seed(platform: str, rows: int, oracle_batch: int) -> Dict[str, Any]:
    import keras_memfit

    model = _model(platform)
    x, _ = _data(platform, rows)
    model.predict(x[:oracle_batch], batch_size=oracle_batch, verbose=0)  # compile
    start = time.perf_counter()
    expected = model.predict(x, batch_size=oracle_batch, verbose=0)
    oracle = time.perf_counter() - start
    count = _Count()
    calls = []
    for _ in range(2):
        before, start = count.ooms, time.perf_counter()
        result = keras_memfit.safe_predict(model, x, batch_size=rows, verbose=0)
        calls.append((time.perf_counter() - start, count.ooms - before,
                      float(np.abs(result - expected).max())))
    weights_ok = all(w is not None for w in model.get_weights())

    def plain():
        model.predict(x, batch_size=rows, verbose=0)
        model.get_weights()  # Keras donated the state: an OOM may surface here

    return {"oracle_s": oracle, "calls": calls, "weights_readable": weights_ok,
            "plain": _plain_fails(plain)}


def child_fit(platform: str, rows: int, out: str, memfit: bool) -> Dict[str, Any]:
    import keras_memfit

    x, y = _data(platform, rows)
    report: Dict[str, Any] = {}
    if memfit:  # under the limit: plain Keras first, on its own model
        doomed = _model(platform)

        def plain():
            doomed.fit(x, y, batch_size=rows, epochs=1, shuffle=False, verbose=0)
            doomed.get_weights()

        report["plain"] = _plain_fails(plain)
        del doomed
    model = _model(platform)
    count = _Count()
    callbacks = [keras_memfit.MemFit()] if memfit else []
    model.fit(x[:64], y[:64], batch_size=64, epochs=1, verbose=0)  # compile, 1 step
    start = time.perf_counter()
    history = model.fit(x, y, batch_size=rows, epochs=2, shuffle=False, verbose=0,
                        callbacks=callbacks)
    report["seconds"] = time.perf_counter() - start
    report["ooms"] = count.ooms
    report["split"] = history.history.get("memfit_split", [1])
    report["history"] = {k: v for k, v in history.history.items() if not k.startswith("memfit")}
    report["iterations"] = int(model.optimizer.iterations.value)
    state = model.get_weights() + [np.asarray(v.value) for v in model.optimizer.variables]
    np.savez(out, *state)
    return report


def _child(argv) -> None:
    scenario, platform, limit_gb = argv[0], argv[1], float(argv[2])
    if platform == "cpu" and limit_gb:
        import resource

        limit = int(limit_gb * GIB)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    args = json.loads(argv[3])
    result = {"seed": child_seed, "fit": child_fit}[scenario](platform, **args)
    print("RESULT " + json.dumps(result))


# ------------------------------------------------------------------ parent
def _run(scenario: str, platform: str, limit_gb: float, env: Dict[str, str],
         **args: Any) -> Dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu", "--child", scenario, platform,
         str(limit_gb), json.dumps(args)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{scenario} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")


def _probe(env: Dict[str, str]) -> Dict[str, Any]:
    code = (
        "import json, jax; d = jax.devices()[0]; s = d.memory_stats() or {}; "
        "print(json.dumps({'platform': d.platform, 'kind': d.device_kind, "
        "'bytes_limit': s.get('bytes_limit'), 'jax': jax.__version__}))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=300, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _limited_env(base: Dict[str, str], probe: Dict[str, Any], gib: float) -> Dict[str, str]:
    env = dict(base)
    if probe["platform"] != "cpu" and probe.get("bytes_limit"):
        # bytes_limit is 75% of the device by default (XLA preallocates that share).
        total = probe["bytes_limit"] / float(base.get("XLA_PYTHON_CLIENT_MEM_FRACTION", 0.75))
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{min(0.9, gib * GIB / total):.4f}"
    return env


def _max_diff(a: str, b: str) -> float:
    left, right = np.load(a), np.load(b)
    return max(float(np.abs(left[k] - right[k]).max()) for k in left.files)


def _section(probe, gib, rows, oracle_batch, fit_rows, seed, free, limited, diff) -> str:
    how = ("XLA_PYTHON_CLIENT_MEM_FRACTION" if probe["platform"] != "cpu"
           else "an address-space limit (RLIMIT_AS)")
    first, second = seed["calls"]
    lines = [
        f"## JAX: less memory than the batch needs ({probe['platform']}, {probe['kind']})",
        "",
        f"Measured {common.now_utc()} UTC with `python -m benchmarks.gpu`: jax "
        f"{probe['jax']}, usable memory shrunk to {gib:g} GiB with {how}.",
        "",
        "| scenario | plain Keras at the full batch | keras_memfit | OOMs paid | "
        "time | equal to the reference |",
        "|---|---|---|---|---|---|",
        f"| predict {rows:,} rows, batch_size={rows:,} | {seed['plain']} | safe_predict, "
        f"1st call | {first[1]} | {first[0]:.2f} s ({first[0] / seed['oracle_s']:.2f}x "
        f"the oracle batch {oracle_batch}: {seed['oracle_s']:.2f} s) | max diff "
        f"{first[2]:.1e} |",
        f"| same | | safe_predict, 2nd call | {second[1]} | {second[0]:.2f} s "
        f"({second[0] / seed['oracle_s']:.2f}x) | max diff {second[2]:.1e} |",
        f"| fit {fit_rows:,} rows, batch_size={fit_rows:,}, 2 epochs | {limited['plain']} "
        f"| MemFit (accumulate), split {max(limited['split'])} | {limited['ooms']} | "
        f"{limited['seconds']:.2f} s (unlimited fit: {free['seconds']:.2f} s) | "
        f"iterations {limited['iterations']} vs {free['iterations']} (1 warm-up step "
        f"included); weights and "
        f"optimizer max diff {diff:.1e} |",
        "",
        "After every OOM the model's weights were readable "
        f"({'yes' if seed['weights_readable'] else 'NO'}): keras_memfit's JAX steps "
        "donate nothing, where Keras's donate the model state to the failing step. "
        "safe_predict's first call includes compiling each new piece size (JAX "
        "compiles per shape).",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--memory-gb", type=float, default=None)
    parser.add_argument("--results", default=os.path.join(ROOT, "benchmarks", "RESULTS.md"))
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child)
        return 0
    base = dict(os.environ, KERAS_BACKEND="jax")
    probe = _probe(base)
    platform = "cpu" if probe["platform"] == "cpu" else "gpu"
    gib, rows, oracle_batch, fit_rows = SETTINGS[platform]
    gib = args.memory_gb or gib
    limited_env = _limited_env(base, probe, gib)
    limit = gib if platform == "cpu" else 0.0
    started = time.perf_counter()
    seed = _run("seed", platform, limit, limited_env, rows=rows, oracle_batch=oracle_batch)
    with tempfile.TemporaryDirectory() as tmp:
        free_out, limited_out = os.path.join(tmp, "free.npz"), os.path.join(tmp, "lim.npz")
        free = _run("fit", platform, 0.0, base, rows=fit_rows, out=free_out, memfit=False)
        limited = _run("fit", platform, limit, limited_env, rows=fit_rows,
                       out=limited_out, memfit=True)
        diff = _max_diff(free_out, limited_out)
    body = _section(probe, gib, rows, oracle_batch, fit_rows, seed, free, limited, diff)
    body += f"\n\nWhole script: {time.perf_counter() - started:.0f} s."
    common.write_section(args.results, KEY, body)
    print(body)
    ok = (seed["plain"] == "OOM" and limited["plain"] == "OOM" and seed["weights_readable"]
          and max(c[2] for c in seed["calls"]) < 1e-4 and diff < 1e-4
          and limited["iterations"] == free["iterations"])
    print("PASS" if ok else "MISS: see the table")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
