"""keras_memfit's footprint against plain Keras: the widest model that fits, peaks, compilations.

keras_memfit must never fit less than plain Keras, in memory or in
compilations (issue #20). Each measurement is against plain Keras:

1. `fit`: the widest `Input(1024) -> Dense(W, relu) -> Dense(1024)` (Adam,
   mse) whose two-step `fit` completes, at `batch_size` 1 and 8, plain
   `model.fit` against `model.fit(callbacks=[MemFit()])` (MemFit may adapt:
   a try "trains" when the call returns). Each width is tried in a fresh
   child process under the limit: TensorFlow's capped CPU allocator
   (500 MiB), or on JAX an address-space limit (3 GiB; JAX's CPU client has
   no capped allocator). The issue measured at 1500 MiB and 5 GiB; the
   smaller limits keep a backend's run near 10 minutes on a 2-core machine
   (`--limit` sets another). A bisection over W, plain Keras first, MemFit
   bracketed around plain's result, batch 1 around batch 8's; it stops when
   the widest width that trains and the narrowest that fails are within 1%
   of W (`RESOLUTION`). Every try is kept, and checked (`check_widest`): each
   width that trained is narrower than each that failed, and plain Keras's
   narrowest failure is a real OOM.
2. `predict`: the same for `safe_predict(model, x, batch_size=B)` against
   `model.predict(x, batch_size=B)`.
3. `peak`: peak memory with no pressure, the same model at a width that fits
   easily: on TensorFlow the BFC allocator's peak
   (`tf.config.experimental.get_memory_info("CPU:0")["peak"]`, large cap,
   `reset_memory_stats` before each call; plain and MemFit fits interleaved
   in one process); on JAX the device's `peak_bytes_in_use` (one variant per
   process, JAX cannot reset it), not available on JAX's CPU client.
4. `compiles`: XLA compilations of the first and second call of
   `safe_predict` and of `fit` with MemFit, where the batch must adapt,
   against the oracle (plain Keras at a batch that fits). TensorFlow:
   `jit_compile=True`, the seed CNN on 28,000 generated digits under a
   600 MiB cap (at the seed's 400 MiB the oracle's fit at batch 128 ran out
   of memory under XLA, and TensorFlow then aborted in its BFC allocator),
   compilations counted from `device_compiler`'s log line;
   JAX (CPU): the seed CNN hardly allocates under XLA's CPU client (it fits in
   5 GiB and fails with INTERNAL, not an OOM, in 2.5), so the `benchmarks.gpu`
   CPU stand-in, Dense(16384) on 8 features, 65,536 rows, under 5 GiB;
   counted with `jax.monitoring`'s backend-compile event. Each child first
   checks its counter on a toy (a jitted function at shapes 3, 3, 4: 2).
5. `fit-jit` (TensorFlow only; JAX always compiles): part 1 with the model
   compiled with `jit_compile=True`, as Keras compiles it on a GPU. Under
   XLA MemFit holds the weights and optimizer slots during the first call
   at each input shape (`backend/tensorflow/holds.XlaHolds`): this part
   measures what that costs at the boundary.
6. `seq`, `image` and `chain`: MemFit's one-sample rung (rematerialization)
   against plain Keras, at batch_size 1: the longest sequence a transformer
   trains on, the widest image a residual conv stack trains on, and the
   widest image a functional chain of Conv2D-BatchNormalization-ReLU blocks
   trains on, cut by MemFit into segments of its graph
   (`footprint_child.rung_model`), each try a fresh process under a limit of
   the same kind as part 1's, smaller (`rung_limit`: 128 MiB, 1.5 GiB,
   0.5 GiB above torch's own); the same bisection, plain Keras first, MemFit
   from 1.5x plain's result upwards, to 20% (`RUNG_RESOLUTION`: a try
   takes 0.5-3 minutes on a shared 2-core machine; `chain` to 5%, its target
   of 1.25 being within 20%). Beside each, what the rung
   costs: seconds per one-sample step at plain Keras's longest (widest)
   size, plain `fit` against `fit` with `MemFit(remat=[...])` recomputing
   the blocks MemFit ended on at its own, interleaved in one process without
   a limit; and MemFit's own estimate (`events[...]["step_time"]`).

Usage (from the repository root):
    python -m benchmarks.footprint --backend tensorflow      # ~15-25 min
    python -m benchmarks.footprint --backend jax
    python -m benchmarks.footprint --backend jax --parts fit --batches 8
    python -m benchmarks.footprint --backend torch   # fit, predict, peak (CUDA only)
    python -m benchmarks.footprint --backend tensorflow --parts fit-jit --batches 8
    python -m benchmarks.footprint --backend jax --parts seq image   # ~10 min
    python -m benchmarks.footprint --backend tensorflow --parts chain
    python -m benchmarks.footprint --quick --output /tmp/R.md --json /tmp/f.json

A run writes its backend's `footprint-<backend>` section of
benchmarks/RESULTS.md (`seq`, `image` and `chain`: the `footprint-rung` section, one
table of every backend) and its entry of benchmarks/footprint.json (`--quick`
writes only where `--output`/`--json` are given).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from benchmarks import common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.join(ROOT, "benchmarks")
PARTS = ("fit", "predict", "peak", "compiles", "fit-jit", "seq", "image", "chain")
RUNG_PARTS = ("seq", "image", "chain")  # batch 1, MemFit's one-sample rung
# Keras's torch steps run eagerly (torch.compile only with jit_compile=True,
# which keras_memfit's steps do not use): no compilations to count.
# "fit-jit" (`jit_compile=True`): TensorFlow only (JAX always compiles with XLA).
BACKEND_PARTS = {"torch": ("fit", "predict", "peak", "seq", "image"),
                 "jax": ("fit", "predict", "peak", "compiles", "seq", "image")}
RESOLUTION = 0.01
RUNG_RESOLUTION = 0.2
CHAIN_RESOLUTION = 0.05  # its target (1.25) is within RUNG_RESOLUTION
RUNG_MEMFIT_BRACKET = (1.5, 2.2)  # MemFit's first bracket, times plain Keras's result
CHAIN_MEMFIT_BRACKET = (1.2, 1.6)
STEP = 8  # widths are multiples of 8
# The rung parts ("seq", "image", "chain"): their own, smaller limit (`rung_limit`: the
# sizes that fill a larger one take minutes a step on a 2-core machine),
# plain Keras's first bracket (tokens, pixels a side), the step-time child.
RUNG = dict(rung_resolution=RUNG_RESOLUTION, chain_resolution=CHAIN_RESOLUTION,
            rung_bracket=RUNG_MEMFIT_BRACKET, chain_bracket=CHAIN_MEMFIT_BRACKET,
            rung_timing=dict(steps=2, rounds=3))
FULL = {
    "tensorflow": dict(limit=500, fit=(12000, 16000), predict=(40000, 64000),
                       peak_width=8192, resolution=RESOLUTION,
                       rung_limit=128, seq=(512, 768), image=(160, 240), chain=(144, 208),
                       **RUNG),
    # JAX: plain Keras's edge under the address-space limit is not sharp (it
    # failed 1 try in 3 well below its widest width, 2026-12-04), so a width
    # counts as failing after 3 fresh tries (plain and keras_memfit alike).
    "jax": dict(limit=3.0, fit=(30000, 60000), predict=(120000, 200000),
                peak_width=8192, resolution=RESOLUTION, confirm=3,
                rung_limit=1.5, seq=(512, 1024), image=(256, 512), chain=(256, 384), **RUNG),
    # torch: GiB of address space above what importing torch maps (the CUDA
    # build maps ~3.8 GB, the CPU build ~0.8 GB: see footprint_child.main).
    "torch": dict(limit=2.0, fit=(30000, 80000), predict=(150000, 300000),
                  peak_width=8192, resolution=RESOLUTION,
                  rung_limit=0.5, seq=(512, 1024), image=(256, 512), chain=(256, 384), **RUNG),
}
# (FULL, QUICK: the plain bisection's first bracket per call; MemFit's is around
# plain's result.)
# Rung parts, quick: a toy limit, two tries per bisection (MemFit's bracket above
# plain's result: its rung must be climbed), one timed round.
QUICK_RUNG = dict(rung_resolution=1.0, chain_resolution=1.0, rung_bracket=(2.0, 4.0),
                  rung_timing=dict(steps=1, rounds=1))
QUICK = {  # two tries per bisection: brackets around the full run's results, coarse
    "tensorflow": dict(limit=500, fit=(12992, 13504), predict=(40000, 64000),
                       peak_width=512, resolution=0.75, memfit_bracket=(0.6, 1.02),
                       rung_limit=32, seq=(192, 288), image=(96, 144), chain=(64, 96),
                       **QUICK_RUNG),
    "jax": dict(limit=3.0, fit=(37504, 40000), predict=(120000, 200000),
                peak_width=512, resolution=0.75, memfit_bracket=(0.6, 1.02),
                rung_limit=1.5, seq=(512, 768), image=(256, 384), chain=(256, 384),
                **QUICK_RUNG),
    "torch": dict(limit=2.0, fit=(40000, 70000), predict=(150000, 300000),
                  peak_width=512, resolution=0.75, memfit_bracket=(0.6, 1.02),
                  rung_limit=0.5, seq=(512, 768), image=(256, 384), chain=(256, 384),
                  **QUICK_RUNG),
}
COMPILES = {
    "tensorflow": dict(limit=600, scenario="cnn", predict_rows=28000, predict_oracle_batch=256,
                       fit_rows=1024, fit_batch=1024, fit_oracle_batch=32),
    "jax": dict(limit=5.0, scenario="dense", predict_rows=65536, predict_oracle_batch=4096,
                fit_rows=32768, fit_batch=32768, fit_oracle_batch=4096),
}
PEAK_CAP_MB = 8192  # TensorFlow: the BFC allocator on (its statistics), far above the need


# ------------------------------------------------------------------ children
def child_env(backend: str, cap_mb: Optional[int], cpu: bool = True) -> Dict[str, str]:
    """A child's environment (`benchmarks.jobs.child_environment`, on `backend`).

    On JAX's CPU client, `MALLOC_ARENA_MAX=1`: each thread's glibc malloc
    arena reserves 64 MiB of address space that it does not use, and how many
    threads get one varies from run to run (measured: about 900 MiB of the
    3 GiB limit reserved so, against about 700 MiB left for the model), so
    under `RLIMIT_AS` they, not the calls, would set the widest model. The
    same environment for plain Keras and keras_memfit.
    """
    from benchmarks import jobs

    if backend == "tensorflow":
        return jobs.child_environment(cap_mb)
    if backend == "torch":
        env = jobs.child_environment(None, "torch")
        if not cpu:
            env.pop("CUDA_VISIBLE_DEVICES", None)
        return env
    env = jobs.child_environment(None, "jax")
    if cpu:
        env["JAX_PLATFORMS"] = "cpu"
        env["MALLOC_ARENA_MAX"] = "1"
    else:
        env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def run_child(env: Dict[str, str], limit_gb: float, config: Dict[str, Any],
              timeout: float = 900) -> Dict[str, Any]:
    """`benchmarks.footprint_child` on `config` in a fresh process; a crash is a result."""
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.footprint_child", str(limit_gb),
             json.dumps(config)],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": "timeout", "oom": False, "detail": f"{timeout} s"}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()][-3:]
    partial = [json.loads(line[len("PARTIAL "):]) for line in proc.stdout.splitlines()
               if line.startswith("PARTIAL ")]
    return dict(partial[-1] if partial else {}, ok=False, oom=False,
                error=f"crash (exit {proc.returncode})", detail=" / ".join(tail)[-300:])


# ----------------------------------------------------------------- bisection
def _round(width: float) -> int:
    return max(STEP, int(round(width / STEP)) * STEP)


def widest(trains: Callable[[int], Dict[str, Any]], lo: int, hi: int,
           resolution: float, confirm: int = 1) -> Dict[str, Any]:
    """The widest width that trains, by bisection between `lo` and `hi`.

    The bisection starts in the middle; the bracket's end on the other side
    of the middle's outcome is tried next (once), and an end that turns out
    wrong widens the bracket (x1.5) before the bisection goes on.

    Args:
        trains: Tries one width; returns a dict with "ok".
        lo: A width expected to train.
        hi: A width expected to fail.
        resolution: Stop when `hi - lo <= resolution * lo` (and `STEP`).
        confirm: Tries a width gets before it counts as failing; a width
            trains if one of them trains.

    Returns:
        {"widest", "failed" (the narrowest width that failed), "resolution",
        "tries": [{"width", "ok", ...}, ...] in the order tried}.
    """
    lo, hi = _round(lo), _round(hi)
    tries: List[Dict[str, Any]] = []
    outcome: Dict[int, bool] = {}

    def attempt(width: int) -> bool:
        if width not in outcome:
            for _ in range(confirm):
                result = trains(width)
                tries.append(dict(width=width, **result))
                if result["ok"]:
                    break
            outcome[width] = bool(result["ok"])
        return outcome[width]

    while True:
        while hi - lo > max(STEP, resolution * lo):
            mid = _round((lo + hi) / 2)
            mid = min(max(mid, lo + STEP), hi - STEP)
            if attempt(mid):
                lo = mid
                if hi not in outcome:  # the first success: is the top really too wide?
                    break
            else:
                hi = mid
                if lo not in outcome:  # the first failure: does the bottom really train?
                    break
        if not attempt(lo):
            hi, lo = lo, _round(lo / 1.5)
            if lo >= hi:
                return {"widest": 0, "failed": hi, "resolution": resolution, "tries": tries}
            continue
        if attempt(hi):
            lo, hi = hi, _round(hi * 1.5)
            continue
        if hi - lo > max(STEP, resolution * lo):  # both ends confirmed: bisect on
            continue
        return {"widest": lo, "failed": hi, "resolution": resolution, "tries": tries}


def check_widest(result: Dict[str, Any], reference: bool) -> List[str]:
    """What is wrong with a bisection's result (empty: nothing).

    Checks that it is monotonic (each width that trained narrower than each
    that failed), that its ends are tries with those outcomes, within its
    resolution, and, for plain Keras (`reference`), that the narrowest
    failure was a real OOM.
    """
    problems = []
    tries = result["tries"]
    good = [t["width"] for t in tries if t["ok"]]
    bad = [t for t in tries if not t["ok"] and t["width"] not in good]  # not retried into training
    if good and bad and max(good) >= min(t["width"] for t in bad):
        problems.append(f"not monotonic: {max(good)} trained, "
                        f"{min(t['width'] for t in bad)} failed")
    if result["widest"] not in good:
        problems.append(f"widest {result['widest']} was not tried and trained")
    failed = [t for t in bad if t["width"] == result["failed"]]
    if not failed:
        problems.append(f"narrowest failure {result['failed']} was not tried and failed")
    elif reference and not failed[0].get("oom"):
        problems.append(f"plain Keras at {result['failed']} failed without an OOM: "
                        f"{failed[0].get('error')}: {failed[0].get('detail', '')}")
    if result["failed"] - result["widest"] > max(STEP, result["resolution"] * result["widest"]):
        problems.append(f"bracket {result['widest']}-{result['failed']} wider than the resolution")
    return problems


def measure_widest(backend: str, call: str, batches: Sequence[int], settings: Dict[str, Any],
                   log: Callable[[str], None]) -> Dict[str, Any]:
    """Plain and keras_memfit bisections of `call` at each batch size."""
    cap = settings["limit"]
    env = child_env(backend, int(cap) if backend == "tensorflow" else None)
    limit_gb = 0.0 if backend == "tensorflow" else float(cap)
    out: Dict[str, Any] = {}
    previous: Dict[bool, int] = {}
    for batch in batches:
        for memfit in (False, True):
            def trains(width: int, memfit: bool = memfit) -> Dict[str, Any]:
                r = run_child(env, limit_gb, dict(part="try", call=call.replace("-jit", ""),
                                                  width=width, batch=batch, memfit=memfit,
                                                  jit_compile=call.endswith("-jit") or "auto"))
                log(f"  {call} batch={batch} {'keras_memfit' if memfit else 'plain'} "
                    f"W={width}: {'trains' if r['ok'] else r.get('error')} "
                    f"({r.get('seconds', 0):.1f} s, ooms caught {r.get('ooms_caught', '-')})")
                return r

            if memfit in previous:  # another batch size: around its result there
                lo, hi = previous[memfit] * 0.97, previous[memfit] * 1.04
            elif memfit:
                plain = out[f"{batch}/plain"]["widest"]
                lo, hi = (plain * f for f in settings.get("memfit_bracket", (0.5, 1.02)))
            else:
                lo, hi = settings[call.replace("-jit", "")]
            start = time.perf_counter()
            result = widest(trains, lo, hi, settings["resolution"], settings.get("confirm", 1))
            result["seconds"] = time.perf_counter() - start
            result["problems"] = check_widest(result, reference=not memfit)
            out[f"{batch}/{'memfit' if memfit else 'plain'}"] = result
            previous[memfit] = result["widest"]
    return out


def measure_rung(backend: str, call: str, settings: Dict[str, Any],
                 log: Callable[[str], None]) -> Dict[str, Any]:
    """A rung part ("seq", "image", "chain"): the bisections at batch 1, then the rung's step time.

    The step time is measured at plain Keras's widest size, recomputing the
    blocks MemFit ended on at its own widest; not measured (None) where
    MemFit recomputed nothing there.
    """
    result = measure_widest(backend, call, [1], dict(
        settings, limit=settings["rung_limit"],
        resolution=settings.get(f"{call}_resolution", settings["rung_resolution"]),
        memfit_bracket=settings.get(f"{call}_bracket", settings["rung_bracket"])), log)
    plain, mine = result["1/plain"], result["1/memfit"]
    top = [t for t in mine["tries"] if t["ok"] and t["width"] == mine["widest"]]
    layers = top[0].get("remat_layers") if top else None
    result["remat_layers"] = layers
    result["remat_estimate"] = top[0].get("remat_estimate") if top else None
    result.update(step_time=None, date=common.now_utc(), limit=settings["rung_limit"])
    if layers and plain["widest"]:
        result["step_time"] = run_child(child_env(backend, None), 0.0, dict(
            part="step-time", call=call, width=plain["widest"], layers=layers,
            **settings["rung_timing"]))
        timing = result["step_time"]
        log(f"  {call} step time at {plain['widest']}: " + (
            f"plain {timing['plain']:.3f} s, MemFit {timing['memfit']:.3f} s "
            f"(x{timing['ratio']:.2f})" if timing["ok"] else f"{timing.get('error')}"))
    return result


def measure_peak(backend: str, settings: Dict[str, Any], repeats: int) -> Dict[str, Any]:
    config = dict(part="peak", width=settings["peak_width"], batch=8, repeats=repeats)
    if backend == "tensorflow":
        return run_child(child_env(backend, PEAK_CAP_MB), 0.0,
                         dict(config, variants=["plain", "memfit"]))
    results = [run_child(child_env(backend, None, cpu=False), 0.0,
                         dict(config, variants=[v])) for v in ("plain", "memfit")]
    if not all(r.get("available") for r in results):
        return {"available": False, "detail": [r.get("error") for r in results]}
    return {"available": True, "param_bytes": results[0]["param_bytes"],
            "runs": {**results[0]["runs"], **results[1]["runs"]}}


def measure_compiles(backend: str) -> Dict[str, Any]:
    """The compile part: `predict` and `fit` calls, each group in a fresh child.

    A group's oracle and keras_memfit calls share one process; the groups do
    not: on TensorFlow the predict group's calls (28,000 rows) grow the capped
    allocator's regions, and a later fit in the same process then ran out of
    memory at a size that fits in a fresh one (no free block large enough
    within the cap: one OOM and one compilation more, measured 2026-12-02).
    """
    config = dict(COMPILES[backend], part="compiles")
    limit = config.pop("limit")
    result: Dict[str, Any] = {}
    for group in ("predict", "fit"):
        child = dict(config, groups=[group])
        if backend == "tensorflow":
            env = child_env(backend, int(limit))
            env.update(TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="device_compiler=1")
            measured = run_child(env, 0.0, child)
        else:
            measured = run_child(child_env(backend, None), limit, child)
        # Each child checks its counter on the toy: a miscount in either is kept.
        miscounted = [r["toy"] for r in (result, measured) if r.get("toy", 2) != 2]
        result.update(measured)
        if miscounted:
            result["toy"] = miscounted[0]
    return dict(result, limit=limit, **config)


# ------------------------------------------------------------------ main
def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=("tensorflow", "jax", "torch"), default=None,
                        help="default: KERAS_BACKEND, else tensorflow")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=None)
    parser.add_argument("--batches", nargs="+", type=int, default=None)
    parser.add_argument("--limit", type=float, default=None,
                        help="MiB (tensorflow), GiB (jax) or GiB above torch's import (torch) "
                             "for the widest-model parts")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny CI configuration (fit and peak, batch 8, two tries a bisection)")
    parser.add_argument("--output", default=None, help="RESULTS.md to write the section into")
    parser.add_argument("--json", default=None, help="JSON file holding each backend's entry")
    parser.add_argument("--report-only", action="store_true",
                        help="only rewrite the section from the JSON file's entry")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    backend = args.backend or os.environ.get("KERAS_BACKEND", "tensorflow")
    if backend not in FULL:
        print(f"error: --backend tensorflow, jax or torch; received {backend!r}",
              file=sys.stderr)
        return 2
    settings = dict((QUICK if args.quick else FULL)[backend])
    if args.limit:
        scale = args.limit / settings["limit"]
        settings.update(limit=args.limit, **{k: (settings[k][0] * scale, settings[k][1] * scale)
                                             for k in ("fit", "predict")})
    parts = args.parts or (["fit", "peak"] if args.quick else list(BACKEND_PARTS.get(backend, PARTS)))
    batches = args.batches or ([8] if args.quick else [8, 1])
    output = args.output or (None if args.quick else os.path.join(HERE, "RESULTS.md"))
    json_path = args.json or (None if args.quick else os.path.join(HERE, "footprint.json"))

    def log(line: str) -> None:
        print(line, flush=True)

    stored: Dict[str, Any] = {}
    if json_path and os.path.exists(json_path):
        with open(json_path) as f:
            stored = json.load(f)
    if args.report_only:
        return _write(stored[backend], output, None, stored)
    started = time.perf_counter()
    info = {"Date (UTC)": common.now_utc(), "CPU": common.cpu_model(),
            "CPU count (usable / total)": common.usable_cpus(),
            "Load average at start (1/5/15 min)": common.load_average()}
    data: Dict[str, Any] = {"backend": backend, "quick": args.quick, "settings": settings,
                            "command": "python -m benchmarks.footprint " + " ".join(argv),
                            "machine": info, "parts": {}}
    for part in parts:
        log(f"{part} ({backend}):")
        part_start = time.perf_counter()
        if part in ("fit", "predict", "fit-jit"):
            result = measure_widest(backend, part, batches, settings, log)
        elif part in RUNG_PARTS:
            result = measure_rung(backend, part, settings, log)
        elif part == "peak":
            result = measure_peak(backend, settings, repeats=1 if args.quick else 3)
        else:
            result = measure_compiles(backend)
        result["part_seconds"] = time.perf_counter() - part_start
        data["parts"][part] = result
        _keep_stored(data, stored.get(backend), part)
    data["seconds"] = time.perf_counter() - started
    if set(parts) <= set(RUNG_PARTS) and stored.get(backend) and not args.quick:
        # Only the rung's parts: the backend's entry and section as they were, plus them.
        old = stored[backend]
        return _write(dict(old, parts=dict(old["parts"], **data["parts"])), output, json_path,
                      stored, backend_section=False)
    if not args.quick:  # a child start saved in the CI smoke run
        data["versions"] = run_child(child_env(backend, None), 0.0, dict(part="versions"))
    if stored.get(backend) and not args.quick:  # the parts (and batches) not run now
        old = stored[backend]
        data["parts"] = dict(old["parts"], **data["parts"])
        if set(old["parts"]) - set(parts) or any(set(batches) != {int(k.split("/")[0])
                                                              for k in v if "/" in k}
                                                 for p, v in data["parts"].items()
                                                 if p in ("fit", "predict", "fit-jit")):
            data["command"] = old["command"] + "`, then `" + data["command"]
            data["seconds"] += old["seconds"]
    return _write(data, output, json_path, stored)


def _keep_stored(data: Dict[str, Any], old: Optional[Dict[str, Any]], part: str) -> None:
    """A widest-model part keeps the stored batch sizes this run did not measure."""
    if not old or data["quick"] or part not in ("fit", "predict", "fit-jit"):
        return
    previous = old["parts"].get(part, {})
    data["parts"][part] = dict({k: v for k, v in previous.items() if "/" in k},
                               **data["parts"][part])


def _write(data: Dict[str, Any], output: Optional[str], json_path: Optional[str],
           stored: Dict[str, Any], backend_section: bool = True) -> int:
    """Print and write the sections (and the JSON entry); 1 if the measurement is invalid.

    The sections: the backend's `footprint-<backend>` (unless not
    `backend_section`), and `footprint-rung` where an entry has rung parts.
    """
    from benchmarks import footprint_report

    backend = data["backend"]
    if json_path:  # first: the raw results survive a failing report
        if os.path.exists(json_path):  # re-read: another backend's run may have written
            with open(json_path) as f:
                stored = json.load(f)
        stored[backend] = data
        with open(json_path, "w") as f:
            json.dump(stored, f, indent=1)
    sections = {}
    if backend_section:
        sections[f"footprint-{backend}"] = footprint_report.section(data)
    entries = dict(stored, **{backend: data})
    if any(set(entry["parts"]) & set(RUNG_PARTS) for entry in entries.values()):
        sections["footprint-rung"] = footprint_report.rung_section(entries)
    for key, body in sections.items():
        print(body)
        if output:
            common.write_section(output, key, body)
            print(f"wrote section '{key}' of {output}")
    problems = footprint_report.problems(data)
    for problem in problems:
        print(f"INVALID MEASUREMENT: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
