"""Every GPU check of keras_memfit, for JAX and torch, in one run.

On the lent GPU machine (JAX 0.11, torch 2.11, CUDA 13, Python 3.12, no
TensorFlow, no Keras, no network), about 8 minutes. First, here, fill the
ignored `wheels/` folder with what Keras needs and that machine lacks
(`bash benchmarks/gpu_wheels.sh`), then call the `run` device tool with:

    carry: ["wheels"]    timeout_s: 600
    command: python3 -m pip install -q --no-index --no-deps --no-compile
      --no-cache-dir --target /tmp/site wheels/*.whl && export
      PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 && nvidia-smi -L; python3
      -m benchmarks.gpu --budget 540 2>&1 | tee $OUT/gpu.log; cp
      benchmarks/RESULTS.md $OUT/

(the command on one line). It writes the `gpu-jax` and `gpu-torch` sections
of benchmarks/RESULTS.md (`$OUT/RESULTS.md` brings it back) and prints them.

Without a GPU (CI, before any GPU run): every scenario of both backends at
toy sizes on the CPU, under an address-space limit (about 5 minutes on 2
cores; tests/test_gpu_cpu_check.py runs it where jax and torch are both
installed):

    python -m benchmarks.gpu --cpu-check [--backends jax torch] [--results PATH]

It prints one line per scenario and the sections, and writes them only to
`--results` where given. A GPU run thus runs no code path for the first time.

Each scenario runs in a fresh child (`benchmarks.gpu_child`) whose memory is
shrunk before the framework starts: on a GPU with
`XLA_PYTHON_CLIENT_MEM_FRACTION` (JAX) or
`torch.cuda.set_per_process_memory_fraction` (torch), on the CPU with
`RLIMIT_AS` above what the framework maps (`memory_gb` below). The
children run float32 at full precision (no TF32), so that results compare
at 1e-4. The scenarios, for each backend:

- seed: `model.predict(x, batch_size=len(x))` fails; `safe_predict` at that
  batch, first and second call: time, OOMs, largest difference, against the
  oracle (`model.predict` at a batch known to fit).
- fit: plain `fit` at the full batch fails; the same `fit` with `MemFit()`
  against the fit without the limit (weights, optimizer variables,
  iterations, History).
- footprint: the widest `Dense(W)` model whose fit completes, plain against
  MemFit (widths tried in increasing order, one child for each; the longest
  sequence at batch 1 waits for MemFit's one-sample rung).
- overhead: fit and predict with no memory pressure, MemFit/safe_predict
  against plain Keras, interleaved, with `common`'s bootstrap interval and
  verdict.
- oom_cost: the forward pass's time to its OOM (the allocator's own retries
  and waits), and the next pass's time against its steady time; whether
  plain `predict` still runs after its own OOM.
- JAX (`benchmarks.gpu_jax`): dispatch (does an OOM raise at the call or at
  the wait), donation (does a failed program delete its donated inputs),
  remat (does `keras.RematScope` lower the compiled train step's memory).
- torch (`benchmarks.gpu_torch`): oom_forms (the OOM errors met), empty_cache
  (`torch.cuda.empty_cache()` between the OOM and the retry).

Each line ends "ok" or "MISS" on what its scenario must show (plain Keras
met a real OOM, keras_memfit's results equal the reference, the OOMs were
recognised); the rest of the line is measured and reported, never checked.
A scenario whose child fails is a MISS line, and the run goes on.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from benchmarks import common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKENDS = ("jax", "torch")
MiB, GIB = 2**20, 2**30
TOLERANCE = 1e-4
"""Largest difference from the reference (predictions, weights, losses) that counts as equal."""


def _widths(first: int, factor: float, count: int) -> List[int]:
    return [int(first * factor**k) // 256 * 256 for k in range(count)]


# Sizes. GPU: the seed CNN on 28,000 digits under 2 GiB of the device (its
# full-batch predict needs about 7 GB); CPU (`--cpu-check`): the Dense(16384)
# stand-in under 2 GiB of address space above the import (its 32,768-row
# predict needs 2 GiB for the hidden layer alone).
SIZES: Dict[str, Dict[str, Any]] = {
    "gpu": {
        "memory_gb": 2.0,
        "seed": {"kind": "cnn", "rows": 28000, "oracle_batch": 1024},
        "fit": {"kind": "cnn", "rows": 8192},
        "footprint": {"memory_gb": 4.0, "batch": 2048, "widths": _widths(16384, 1.25, 12)},
        "overhead": {"kind": "cnn", "rows": 8192, "batch": 256, "repeats": 7},
        "oom_cost": {"kind": "cnn", "fails": 28000, "fits": 1024, "tries": 3},
        "dispatch": {"huge_floats": 1 << 30},
        "donation": {"huge_floats": 1 << 30},
        "remat": {"depth": 8, "width": 4096, "batch": 8192},
        "oom_forms": {"kind": "cnn", "huge_bytes": 4 * GIB, "rows": 28000},
        "empty_cache": {"kind": "cnn", "fails": 28000, "fits": 1024, "rounds": 2},
    },
    "cpu": {
        "memory_gb": 2.0,
        "seed": {"kind": "dense", "rows": 32768, "oracle_batch": 2048},
        "fit": {"kind": "dense", "rows": 16384},
        "footprint": {"memory_gb": 1.0, "batch": 64, "widths": _widths(4096, 2.0, 5)},
        "overhead": {"kind": "cnn", "rows": 256, "batch": 64, "repeats": 3},
        "oom_cost": {"kind": "dense", "fails": 65536, "fits": 2048, "tries": 2},
        "dispatch": {"huge_floats": 1 << 30},
        "donation": {"huge_floats": 1 << 30},
        "remat": {"depth": 4, "width": 512, "batch": 1024},
        "oom_forms": {"kind": "dense", "huge_bytes": 4 * GIB, "rows": 65536},
        "empty_cache": {"kind": "dense", "fails": 65536, "fits": 2048, "rounds": 1},
    },
}


@dataclasses.dataclass
class Check:
    """One scenario's outcome: a one-line summary, and whether what it checks held."""

    name: str
    summary: str
    ok: bool


class ChildFailed(RuntimeError):
    """A scenario's child exited without a result."""


@dataclasses.dataclass
class Backend:
    """Runs one backend's scenario children, with the environment and limits its probe found."""

    name: str
    cpu_check: bool
    probe: Dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def env(self) -> Dict[str, str]:
        env = dict(os.environ, KERAS_BACKEND=self.name)
        if self.cpu_check:
            env.update(JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="")
        return env

    @property
    def sizes(self) -> Dict[str, Any]:
        return SIZES[self.probe["platform"]]

    def child(self, scenario: str, memory_gb: Optional[float] = None,
              **args: Any) -> Dict[str, Any]:
        """`scenario` in a fresh child; its memory the sizes' `memory_gb` unless given (0: none)."""
        config = {"scenario": scenario, "args": args,
                  "memory_gb": self.sizes["memory_gb"] if memory_gb is None else memory_gb,
                  **{k: self.probe.get(k) for k in ("platform", "baseline_bytes",
                                                     "device_bytes")}}
        return self._run(config)

    def run_probe(self) -> None:
        """The platform, versions, device size and import baseline (`gpu_child.probe`).

        Run with no limit; JAX takes half the device (its `bytes_limit` then
        tells the device's size).
        """
        config = {"scenario": "probe", "memory_gb": 0}
        half = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"} if self.name == "jax" else {}
        self.probe = self._run(config, half)

    def _run(self, config: Dict[str, Any], extra_env: Optional[Dict[str, str]] = None,
             ) -> Dict[str, Any]:
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "benchmarks.gpu_child", json.dumps(config)],
                cwd=ROOT, env=dict(self.env, **(extra_env or {})), capture_output=True,
                text=True, timeout=300,
            )
        except subprocess.TimeoutExpired as err:
            raise ChildFailed(f"{config['scenario']}: no result in {err.timeout:.0f} s") from None
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT "):])
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])[-400:]
        raise ChildFailed(f"{config['scenario']}: exit {proc.returncode}: {tail}")


# --------------------------------------------------------------- the checks
def _s(seconds: float) -> str:
    return f"{seconds:.2f} s"


def check_seed(b: Backend) -> Check:
    sizes = b.sizes["seed"]
    seed = b.child("seed", **sizes)
    first, second = seed["calls"]
    oracle = seed["oracle_s"]
    summary = (
        f"{sizes['kind']}, {sizes['rows']:,} rows: plain predict at the full batch "
        f"{seed['plain']}; safe_predict 1st call {_s(first[0])} ({first[0] / oracle:.2f}x the "
        f"oracle at batch {sizes['oracle_batch']}, {_s(oracle)}), {first[1]} OOMs, max diff "
        f"{first[2]:.1e}; 2nd call {_s(second[0])} ({second[0] / oracle:.2f}x), {second[1]} "
        f"OOMs, max diff {second[2]:.1e}; weights readable after the OOMs: "
        f"{'yes' if seed['weights_readable'] else 'NO'}")
    ok = (seed["plain"] == "OOM" and seed["weights_readable"]
          and max(first[2], second[2]) < TOLERANCE)
    return Check("seed", summary, ok)


def _max_diff(left: str, right: str) -> float:
    a, b = np.load(left), np.load(right)
    return max(float(np.abs(a[k] - b[k]).max()) for k in a.files)


def check_fit(b: Backend) -> Check:
    sizes = b.sizes["fit"]
    with tempfile.TemporaryDirectory() as tmp:
        free_out, limited_out = os.path.join(tmp, "free.npz"), os.path.join(tmp, "limited.npz")
        free = b.child("fit", memory_gb=0, out=free_out, memfit=False, **sizes)
        limited = b.child("fit", out=limited_out, memfit=True, **sizes)
        diff = _max_diff(free_out, limited_out)
    history = max(abs(x - y) for key in free["history"]
                  for x, y in zip(free["history"][key], limited["history"][key]))
    summary = (
        f"{sizes['kind']}, {sizes['rows']:,} rows at batch_size={sizes['rows']:,}, 2 epochs: "
        f"plain fit {limited['plain']}; MemFit {_s(limited['seconds'])} (unlimited fit "
        f"{_s(free['seconds'])}), {limited['ooms']} OOMs, split {max(limited['split'])}; "
        f"against the unlimited fit: weights and optimizer max diff {diff:.1e}, History "
        f"max diff {history:.1e}, iterations {limited['iterations']} vs {free['iterations']}")
    ok = (limited["plain"] == "OOM" and diff < TOLERANCE and history < TOLERANCE
          and limited["iterations"] == free["iterations"])
    return Check("fit", summary, ok)


def _widest(tries: List[Dict[str, Any]]) -> str:
    trained = [t["width"] for t in tries if t["ok"]]
    failed = [t for t in tries if not t["ok"]]
    text = f"W={max(trained):,}" if trained else "none"
    if failed:
        error = failed[0]["error"]
        text += (f" (W={failed[0]['width']:,}: {error['type'].split('.')[-1]} "
                 f"\"{error['line'][:80]}\", {'an OOM' if error['oom'] else 'NOT an OOM'})")
    else:
        text += " (no width failed: widen the search)"
    return text


def check_footprint(b: Backend) -> Check:
    sizes = dict(b.sizes["footprint"])
    gib = sizes.pop("memory_gb")
    plain = b.child("footprint", memory_gb=gib, memfit=False, **sizes)["tries"]
    memfit = b.child("footprint", memory_gb=gib, memfit=True, **sizes)["tries"]

    def widest(tries):
        return max([t["width"] for t in tries if t["ok"]], default=0)

    summary = (f"Dense(1024 > W > 1024), Adam, batch {sizes['batch']}, {gib:g} GiB, widths "
               f"{sizes['widths'][0]:,} to {sizes['widths'][-1]:,}: widest that trains, plain "
               f"{_widest(plain)}; MemFit {_widest(memfit)}; MemFit trains as wide as plain "
               f"Keras: {'yes' if widest(memfit) >= widest(plain) else 'NO'}")
    # Checked: each search met a width that trains and one that fails with an OOM
    # (the comparison is the measurement, in the line).
    ok = all(widest(tries) > 0 and not tries[-1]["ok"] and tries[-1]["error"]["oom"]
             for tries in (plain, memfit))
    return Check("footprint", summary, ok)


def check_overhead(b: Backend) -> Check:
    sizes = b.sizes["overhead"]
    times = b.child("overhead", memory_gb=0, **sizes)["times"]
    parts = []
    for call in ("fit", "predict"):
        result = common.Result(sizes["kind"], call, sizes["batch"], sizes["rows"],
                               sizes["repeats"], times[call]["keras"], times[call]["memfit"])
        parts.append(f"{call} {result.ratio:.3f}x ({common.OVERHEAD_CONFIDENCE:.0%} interval "
                     f"{result.interval_text}, target <= {result.target}: {result.verdict})")
    summary = (f"{sizes['kind']}, {sizes['rows']:,} rows, batch {sizes['batch']}, "
               f"{sizes['repeats']} interleaved pairs, no limit: " + "; ".join(parts))
    return Check("overhead", summary, True)  # a measurement: its verdict is in the line


def check_oom_cost(b: Backend) -> Check:
    sizes = b.sizes["oom_cost"]
    cost = b.child("oom_cost", **sizes)
    tries = cost["tries"]
    later = tries[1:] or tries
    keras_oom, keras_next = cost["keras"]
    summary = (
        f"{sizes['kind']}, its forward pass at {sizes['fails']:,} rows: "
        f"{', '.join(t['outcome'] for t in tries)}; time to the error "
        f"{_s(tries[0]['to_error_s'])} the first time (on JAX it compiles the shape), then "
        f"median {_s(statistics.median(t['to_error_s'] for t in later))}; the next pass at "
        f"{sizes['fits']:,} rows {', '.join(t['next'] for t in tries)}, median "
        f"{_s(statistics.median(t['next_s'] for t in tries))} against "
        f"{_s(cost['steady_s'])} steady. Plain predict at {sizes['fails']:,} rows: "
        f"{keras_oom}; the same model's predict at {sizes['fits']:,} rows after it: {keras_next}")
    ok = all(t["outcome"] == "OOM" and t["next"] == "fits" for t in tries)
    return Check("oom_cost", summary, ok)


def _raised(result: Dict[str, Any]) -> str:
    error = result.get("error")
    text = f"at the {result['where']}" if result["where"] != "none" else "nothing raised"
    if error:
        text += f" after {_s(result['seconds'])} ({error['type'].split('.')[-1]}"
        text += ", an OOM)" if error["oom"] else ", NOT an OOM)"
    return text


def _oom_raised(result: Dict[str, Any]) -> bool:
    return result["where"] != "none" and bool(result.get("error") and result["error"]["oom"])


def check_dispatch(b: Backend) -> Check:
    sizes = b.sizes["dispatch"]
    found = b.child("dispatch", **sizes)
    summary = (f"a program needing {sizes['huge_floats'] * 4 / GIB:g} GiB, compiled first: "
               f"temporary buffer: {_raised(found['temp'])}; output: {_raised(found['output'])}")
    return Check("dispatch", summary, _oom_raised(found["temp"]) and _oom_raised(found["output"]))


def check_donation(b: Backend) -> Check:
    found = b.child("donation", **b.sizes["donation"])
    failed, chained = found["failed"], found["chained"]

    def deleted(result):
        return "DELETED" if result["donated_deleted"] else "kept"

    summary = (f"a donating program that runs out of memory ({_raised(failed)}): donated input "
               f"{deleted(failed)}; a donating program on a failed program's outputs "
               f"({_raised(chained)}): donated input {deleted(chained)}")
    return Check("donation", summary, _oom_raised(failed))


def check_remat(b: Backend) -> Check:
    sizes = b.sizes["remat"]
    found = b.child("remat", memory_gb=0, **sizes)
    plain, remat, kept = found["plain"], found["remat"], found["remat_kept"]

    def mib(n):
        return f"{n / MiB:,.1f} MiB"

    summary = (f"{sizes['depth']} x Dense({sizes['width']}), batch {sizes['batch']}, Keras's "
               f"train_step compiled: temp {mib(plain['temp_bytes'])} plain, "
               f"{mib(remat['temp_bytes'])} under RematScope(mode='full') "
               f"({remat['temp_bytes'] / max(plain['temp_bytes'], 1):.2f}x), "
               f"{mib(kept['temp_bytes'])} with cse_barrier_expander off "
               f"({kept['temp_bytes'] / max(plain['temp_bytes'], 1):.2f}x); peak "
               f"{mib(plain['peak_bytes'])} vs {mib(remat['peak_bytes'])} vs "
               f"{mib(kept['peak_bytes'])}")
    return Check("remat", summary, plain["temp_bytes"] > 0)


def check_oom_forms(b: Backend) -> Check:
    sizes = b.sizes["oom_forms"]
    found = b.child("oom_forms", **sizes)
    parts = []
    for place, form in found["forms"].items():
        if form is None:
            parts.append(f"{place}: nothing raised")
        else:
            parts.append(f"{place}: {form['type']} \"{form['line'][:100]}\" "
                         f"({'an OOM' if form['oom'] else 'NOT an OOM'})")
    summary = f"on {found['device']}, {sizes['huge_bytes'] / GIB:g} GiB asked: " + "; ".join(parts)
    ok = all(form is not None and form["oom"] for form in found["forms"].values())
    return Check("oom_forms", summary, ok)


def check_empty_cache(b: Backend) -> Check:
    sizes = b.sizes["empty_cache"]
    found = b.child("empty_cache", **sizes)
    parts = []
    for clear in (False, True):
        runs = [r for r in found["runs"] if r["empty_cache"] == clear]
        text = (f"{'with' if clear else 'without'} empty_cache: retries "
                f"{', '.join(r['retry'] for r in runs)}, median "
                f"{_s(statistics.median(r['retry_s'] for r in runs))}")
        if clear:
            text += f", the call {statistics.median(r['empty_cache_s'] for r in runs) * 1e3:.1f} ms"
        stats = runs[0]["after_oom"], runs[0]["before_retry"]
        if stats[0] is not None:
            text += (f", reserved {stats[0]['reserved'] / MiB:,.0f} MiB after the OOM, "
                     f"{stats[1]['reserved'] / MiB:,.0f} MiB at the retry")
        parts.append(text)
    summary = (f"on {found['device']}, {sizes['kind']}: OOM at {sizes['fails']:,} rows, retry at "
               f"{sizes['fits']:,}: " + "; ".join(parts))
    ok = all(r["failed"] == "OOM" and r["retry"] == "fits" for r in found["runs"])
    return Check("empty_cache", summary, ok)


CHECKS: Dict[str, List[Callable[[Backend], Check]]] = {
    "jax": [check_seed, check_fit, check_footprint, check_overhead, check_oom_cost,
            check_dispatch, check_donation, check_remat],
    "torch": [check_seed, check_fit, check_footprint, check_overhead, check_oom_cost,
              check_oom_forms, check_empty_cache],
}


# ------------------------------------------------------------------ report
def section(b: Backend, checks: List[Check], seconds: float) -> str:
    probe, sizes = b.probe, b.sizes
    if probe["platform"] == "gpu":
        how = ("XLA_PYTHON_CLIENT_MEM_FRACTION" if b.name == "jax"
               else "torch.cuda.set_per_process_memory_fraction")
        limit = f"{sizes['memory_gb']:g} GiB of the device's {probe['device_bytes'] / GIB:.0f} GiB"
    else:
        how = "an address-space limit (RLIMIT_AS)"
        limit = (f"{sizes['memory_gb']:g} GiB above the {probe['baseline_bytes'] / GIB:.1f} GiB "
                 "the framework maps")
    lines = [
        f"## {b.name}: less memory than the batch needs ({probe['platform']}, {probe['device']})",
        "",
        f"Measured {common.now_utc()} UTC with `python -m benchmarks.gpu"
        f"{' --cpu-check' if b.cpu_check else ''}`: {probe['framework']}, Keras "
        f"{probe['keras']}; usable memory {limit}, set with {how}, in a fresh process per "
        f"scenario; float32 at full precision. {seconds:.0f} s for this backend.",
        "",
        "| scenario | what was measured | checked |",
        "|---|---|:---:|",
    ]
    lines += [f"| {c.name} | {c.summary} | {'ok' if c.ok else '**MISS**'} |" for c in checks]
    return "\n".join(lines)


def run_backend(name: str, cpu_check: bool, deadline: float) -> Tuple[List[Check], str]:
    """Probe `name` and run its checks, each printed as it ends; the checks and the section."""
    b = Backend(name, cpu_check)
    started = time.perf_counter()
    b.run_probe()
    if b.probe["platform"] != "gpu" and not cpu_check:
        raise SystemExit(f"error: {name} sees no GPU here ({b.probe['device']}); "
                         "run with --cpu-check")
    checks = []
    for check in CHECKS[name]:
        name_of = check.__name__[len("check_"):]
        if time.perf_counter() > deadline:
            checks.append(Check(name_of, "not run: the time budget was spent", False))
        else:
            try:
                checks.append(check(b))
            except ChildFailed as err:
                checks.append(Check(name_of, f"the child failed: {err}", False))
        last = checks[-1]
        print(f"{name} {last.name}: {'ok' if last.ok else 'MISS'}: {last.summary}", flush=True)
    return checks, section(b, checks, time.perf_counter() - started)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu-check", action="store_true",
                        help="every scenario at toy sizes on the CPU (no GPU needed)")
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--results", default=None,
                        help="RESULTS.md to write the sections to (default: "
                        "benchmarks/RESULTS.md on a GPU, none with --cpu-check)")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds after which the remaining scenarios are skipped")
    args = parser.parse_args(argv)
    results = args.results or (None if args.cpu_check else
                               os.path.join(ROOT, "benchmarks", "RESULTS.md"))
    deadline = time.perf_counter() + (args.budget or float("inf"))
    ok = True
    for name in args.backends:
        checks, body = run_backend(name, args.cpu_check, deadline)
        ok = ok and all(c.ok for c in checks)
        if results:
            common.write_section(results, f"gpu-{name}", body)
        print(body + "\n", flush=True)
    print("PASS" if ok else "MISS: see the lines above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
