"""One entry point for every benchmark: `python -m benchmarks.run`.

Runs the scenarios, each job in a fresh child process under TensorFlow's
capped CPU allocator (see `benchmarks.jobs`), repeats and interleaves them,
stores the raw measurements in `benchmarks/results.json`, and regenerates
`benchmarks/RESULTS.md` (its generated sections; hand-written `notes:`
sections are kept) and `benchmarks/results.png`.

Scenarios (see each module's docstring for the method):

1. `overhead`: no memory pressure; `safe_predict`/`safe_evaluate`/`MemFit`
   against `model.predict`/`evaluate`/`fit` (benchmarks/overhead.py).
2. `seed`: 28,000 digits under a 400 MiB cap; time to predictions and OOMs
   paid for today's workarounds, `safe_predict` and the oracle (seed.py).
3. `hostmem`: peak host memory for a 200,000 x 1,000 output (hostmem.py).
4. `training`: `MemFit()`, `MemFit(mode="shrink")` and restarting with a
   smaller batch under the cap, against the uncapped run (training.py).
5. `scaling`: time against the number of samples (1,000 to 100,000) and
   against how far the requested batch overshoots (the seed scenario's model
   and cap). At 100,000 a probe (`model.predict` at a batch of 32) first shows
   whether the model.predict-based approaches can run at all.

Usage (from the repository root):
    python -m benchmarks.run                      # everything, ~30-40 min
    python -m benchmarks.run --scenarios seed     # one scenario; the others'
                                                  # stored results are kept
    python -m benchmarks.run --quick              # smoke run, seconds per
                                                  # scenario, into a temp dir
    python -m benchmarks.run --report-only        # redraw from results.json
    python -m benchmarks.run --backend jax        # the overhead scenario on
                                                  # JAX (no TensorFlow needed):
                                                  # its own "overhead-jax" section
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from benchmarks import common, hostmem, jobs, plot, report, seed, training

HERE = os.path.dirname(os.path.abspath(__file__))
SCENARIOS = ("overhead", "seed", "hostmem", "training", "scaling")
SEED_CAP_MB = 400  # the demo's cap: ~1,000 of the CNN's samples fit
OVERHEAD_CAP_MB = 8192  # capped allocator, far above what the overhead cases use


class Context:
    """What every scenario needs: mode, folders, logging and the command line."""

    def __init__(self, quick: bool, workdir: str, command: str,
                 log: Callable[[str], None], stored: Dict[str, Any]) -> None:
        self.quick = quick
        self.workdir = workdir
        self.command = command
        self.log = log
        self.stored = stored

    def stamp(self) -> Dict[str, str]:
        return dict(
            date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
            command=self.command,
        )

    def jobs(self, target: str, configs: List[Dict[str, Any]], cap_mb: Optional[int],
             timeout: float = 1800) -> List[Dict[str, Any]]:
        """Run `target` on each config, each in a fresh process.

        With --quick everything already runs in one uncapped child process
        (`quick_job`): starting TensorFlow would cost more than the work.
        """
        if self.quick:
            return [jobs.run_here(target, config) for config in configs]
        results = []
        for config in configs:
            result = jobs.run_job(target, config, cap_mb=cap_mb, timeout=timeout)
            results.append(result)
            if "seconds" not in result:
                continue
            self.log(f"  {target.split(':')[0].split('.')[-1]} "
                     + " ".join(f"{k}={v}" for k, v in config.items()
                                if k in ("approach", "n", "requested", "factor"))
                     + f": {result.get('seconds', float('nan')):.2f} s, "
                     + f"ooms={result.get('ooms', '-')}, "
                     + f"batch={result.get('batch_size', '-')}"
                     + (f", added={result['added_share']:.3f}" if "added_share" in result else "")
                     + (f", loss={result['final_loss']:.5f}" if "final_loss" in result else ""))
        return results


def _rotate(items: Sequence[Any], r: int) -> List[Any]:
    """`items` rotated by `r`, so that each takes its turn first across rounds."""
    r %= max(1, len(items))
    return list(items[r:]) + list(items[:r])


# --------------------------------------------------------------------------
# Scenarios (parent side: plan the jobs, run them, return raw results)
# --------------------------------------------------------------------------
def run_overhead_jax(ctx: Context, results_md: str) -> Dict[str, Any]:
    """The overhead scenario with Keras on JAX, in a fresh process, uncapped.

    The child writes its own section ("overhead-jax") of `results_md`.
    """
    path = os.path.join(ctx.workdir, "overhead-jax.json")
    args = ["--json", path, "--output", results_md]
    args += ["--quick", "--models", "mlp", "--no-write"] if ctx.quick else ["--repeats", "11"]
    start = time.perf_counter()

    def show(line: str) -> None:
        if line.startswith("ratio "):
            ctx.log("  " + line)

    jobs.run_job("benchmarks.overhead:job", dict(args=args), cap_mb=None, timeout=3600,
                 report=show, backend="jax")
    with open(path) as f:
        data = json.load(f)
    return dict(ctx.stamp(), cases=data["cases"], machine=data["machine"], cap_mb=0,
                seconds=time.perf_counter() - start)


def run_overhead(ctx: Context) -> Dict[str, Any]:
    path = os.path.join(ctx.workdir, "overhead.json")
    args = ["--no-write", "--json", path]
    args += ["--quick", "--models", "mlp"] if ctx.quick else ["--repeats", "11"]
    start = time.perf_counter()
    if ctx.quick:
        from benchmarks import overhead

        overhead.main(args)
        with open(path) as f:
            data = json.load(f)
        return dict(ctx.stamp(), cases=data["cases"], cap_mb=0,
                    seconds=time.perf_counter() - start)
    def show(line: str) -> None:
        if line.startswith("ratio "):
            ctx.log("  " + line)

    jobs.run_job("benchmarks.overhead:job", dict(args=args), cap_mb=OVERHEAD_CAP_MB,
                 timeout=3600, report=show)
    with open(path) as f:
        data = json.load(f)
    return dict(ctx.stamp(), cases=data["cases"], cap_mb=OVERHEAD_CAP_MB,
                seconds=time.perf_counter() - start)


def _seed_setup(ctx: Context, reuse: bool = False) -> Dict[str, Any]:
    """The seed data and the oracle's batch: calibrated, or with `reuse` the stored one.

    `reuse` (the seed scenario is not re-run, e.g. `--scenarios scaling`) takes
    the seed scenario's stored oracle batch when it was calibrated for the same
    samples and cap, so that both sections use the same batch and the ~15
    bisection tries (several paying a ~10 s OOM) are not repeated.
    """
    n = 256 if ctx.quick else 28000
    cap = None if ctx.quick else SEED_CAP_MB
    path = seed.digits_path(ctx.workdir, n)
    stored = ctx.stored.get("seed", {})
    if ctx.quick:
        calib = dict(oracle_batch=n, smallest_failed=None)
    elif (reuse and stored.get("oracle_batch") and stored.get("n") == n
          and stored.get("cap_mb") == cap):
        calib = dict(oracle_batch=stored["oracle_batch"],
                     smallest_failed=stored.get("smallest_failed"))
        ctx.log(f"  oracle batch {calib['oracle_batch']}: the seed scenario's, calibrated on "
                f"{stored.get('date')} UTC (not re-run)")
    else:
        calib = seed.calibrate(
            lambda b: jobs.run_job("benchmarks.seed:try_job",
                                    dict(data_path=path, n=n, batch_size=b), cap_mb=cap)["ok"],
            n, confirm=3,
        )
        ctx.log(f"  oracle batch {calib['oracle_batch']} (tries: {calib['tries']}; "
                f"stored before: {stored.get('oracle_batch')})")
    return dict(n=n, cap=cap, path=path, oracle_batch=calib["oracle_batch"],
                smallest_failed=calib.get("smallest_failed"))


def run_seed(ctx: Context, setup: Dict[str, Any]) -> Dict[str, Any]:
    n, cap, path = setup["n"], setup["cap"], setup["path"]
    reference = os.path.join(ctx.workdir, f"seed_reference_{n}.npy")
    if os.path.exists(reference):
        os.remove(reference)
    base = dict(data_path=path, n=n, requested=n, oracle_batch=setup["oracle_batch"],
                reference_path=reference)
    if ctx.quick:
        rounds = [["oracle", "safe", "halving", "decay", "finder", "manual_split"]]
        note = "1 (--quick)"
    else:
        # The oracle first: its predictions are the reference the others are checked against.
        # The approaches that pay many ~10 s OOMs run in fewer rounds (their time is the
        # OOM waits, which do not vary), the 0.9 decay (~35 OOMs) once.
        cheap, costly = ["safe", "oracle"], ["halving", "finder", "manual_split"]
        rounds = [["oracle"] + _rotate(["safe"] + costly, 0) + ["decay"],
                  _rotate(cheap + costly, 1), _rotate(cheap, 0), _rotate(cheap, 1),
                  _rotate(cheap, 0)]
        note = ("safe_predict and the oracle 5 runs each, halving, the finder and the manual "
                "split 2 each, the 0.9 decay once (it pays ~35 OOMs of ~10 s), in rotating "
                "order")
    configs = [dict(base, approach=a) for r in rounds for a in r]
    runs = ctx.jobs("benchmarks.seed:job", configs, cap, timeout=2400)
    return dict(ctx.stamp(), runs=runs, n=n, requested=n, cap_mb=cap or 0,
                oracle_batch=setup["oracle_batch"], smallest_failed=setup["smallest_failed"],
                repeats_note=note)


def run_hostmem(ctx: Context) -> Dict[str, Any]:
    n, width = (8192, 100) if ctx.quick else (200_000, 1000)
    batch = 256 if ctx.quick else 1024
    rounds = 1 if ctx.quick else 2
    configs = [dict(approach=a, n=n, width=width, batch_size=batch)
               for r in range(rounds) for a in _rotate(hostmem.APPROACHES, r)]
    runs = ctx.jobs("benchmarks.hostmem:job", configs, None)
    return dict(ctx.stamp(), runs=runs, n=n, width=width, batch_size=batch, repeats=rounds,
                output_bytes=n * width * 4)


def run_training(ctx: Context) -> Dict[str, Any]:
    n, batch, epochs = (256, 64, 1) if ctx.quick else (8192, 1024, 3)
    cap = None if ctx.quick else SEED_CAP_MB
    rounds = 1 if ctx.quick else 2
    path = training.data_path(ctx.workdir, n)
    configs = [dict(approach=a, data_path=path, n=n, batch_size=batch, epochs=epochs)
               for r in range(rounds) for a in _rotate(training.APPROACHES, r)]
    runs = []
    for config in configs:  # the uncapped reference gets its own, larger cap
        job_cap = training.UNCAPPED_MB if config["approach"] == "uncapped" else cap
        runs += ctx.jobs("benchmarks.training:job", [config], job_cap, timeout=1800)
    return dict(ctx.stamp(), runs=runs, n=n, batch_size=batch, epochs=epochs,
                cap_mb=cap or 0, repeats=rounds)


def run_scaling(ctx: Context, setup: Dict[str, Any]) -> Dict[str, Any]:
    path, cap, ob = setup["path"], setup["cap"], setup["oracle_batch"]
    approaches = ["oracle", "safe", "halving"]
    if ctx.quick:
        sizes, large, factors, over_n = [128, 256], [512], [1, 2], 256
    else:
        # 28,000 is the seed scenario's (merged at report time). 100,000 needs its own
        # data file, and a probe first: `model.predict` holds the whole input on the
        # device, 314 MB of the 400 MiB cap.
        sizes, large, factors, over_n = [1000, 3000, 10000], [100_000], [1, 2, 4, 8], 10000
    base = dict(data_path=path, oracle_batch=ob)
    sample_configs = [dict(base, approach=a, n=n, requested=n)
                      for n in sizes for a in _rotate(approaches, sizes.index(n))]
    samples = ctx.jobs("benchmarks.seed:job", sample_configs, cap)
    probes = []
    for n in large:
        large_path = seed.digits_path(ctx.workdir, n)
        probe = ctx.jobs("benchmarks.seed:probe_job",
                         [dict(data_path=large_path, n=n, batch_size=seed.PROBE_BATCH)], cap)[0]
        probes.append(probe)
        ctx.log(f"  probe: model.predict on {n:,} samples, batch_size={seed.PROBE_BATCH}: "
                + ("ran" if probe["ok"] else f"{probe['error']} ({probe['detail']})")
                + f" after {probe['seconds']:.1f} s")
        # Where even a small batch fails, so does every model.predict-based approach at
        # any batch (the failure is the whole input), so they are not run there.
        run = [a for a in approaches if probe["ok"] or a not in seed.WHOLE_INPUT]
        samples += ctx.jobs("benchmarks.seed:job",
                            [dict(data_path=large_path, oracle_batch=ob, approach=a, n=n,
                                  requested=n) for a in run], cap, timeout=2400)
    over_configs = [dict(base, approach=a, n=over_n, requested=min(over_n, f * ob), factor=f)
                    for f in factors for a in _rotate(approaches[1:], factors.index(f))]
    overshoot = ctx.jobs("benchmarks.seed:job", over_configs, cap)
    for p, c in zip(overshoot, over_configs):
        p["factor"], p["requested"] = c["factor"], c["requested"]
    oracle = [p["seconds"] for p in samples if p["approach"] == "oracle" and p["n"] == over_n]
    return dict(ctx.stamp(), samples=samples, overshoot=overshoot, approaches=approaches,
                probes=probes, cap_mb=cap or 0, oracle_batch=ob, overshoot_n=over_n,
                overshoot_oracle_seconds=oracle[0] if oracle else None)


# --------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------
def machine(ctx: Context) -> Dict[str, str]:
    info = {"CPU": common.cpu_model(), "CPU count (usable / total)": common.usable_cpus()}
    try:
        with open("/proc/meminfo") as f:
            total = int(f.readline().split()[1]) * 1024
        info["RAM"] = f"{total / 2**30:.0f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    info["OS"] = platform.platform()
    versions = ctx.jobs("benchmarks.jobs:versions_job", [{}], None)[0]
    versions.pop("process_seconds", None)
    info.update(versions)
    load = common.load_average()
    if load != "n/a":
        info["Load average at start (1/5/15 min)"] = load
    return info


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description="Run keras_memfit's benchmarks; write RESULTS.md and results.png.",
    )
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: tiny sizes, no cap, one process per scenario; "
                             "writes into a temporary folder unless --output is given")
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--output", default=None,
                        help="folder for RESULTS.md, results.png and results.json "
                             "(default: benchmarks/, or a new temporary folder with --quick)")
    parser.add_argument("--report-only", action="store_true",
                        help="only regenerate RESULTS.md and the plot from results.json")
    parser.add_argument("--no-plot", action="store_true", help="do not draw results.png")
    parser.add_argument("--backend", choices=("tensorflow", "jax"), default="tensorflow",
                        help="Keras's backend; with jax only the overhead scenario runs "
                             "(the others use TensorFlow's capped allocator)")
    args = parser.parse_args(argv)
    if args.backend == "jax" and set(args.scenarios) - {"overhead"}:
        args.scenarios = ["overhead"]
    return args


def run_scenarios(ctx: Context, names: Sequence[str],
                  save: Callable[[], None]) -> List[str]:
    """Run the scenarios `names` into `ctx.stored`; returns the names that failed."""
    ctx.stored["machine"] = machine(ctx)
    ctx.log("machine: " + "; ".join(f"{k}: {v}" for k, v in ctx.stored["machine"].items()))
    setup = None
    failed = []
    for name in SCENARIOS:
        if name not in names:
            continue
        ctx.log(f"scenario {name} ...")
        t = time.perf_counter()
        try:
            if name in ("seed", "scaling") and setup is None:
                setup = _seed_setup(ctx, reuse="seed" not in names)
            runner = {
                "overhead": lambda: run_overhead(ctx),
                "seed": lambda: run_seed(ctx, setup),
                "hostmem": lambda: run_hostmem(ctx),
                "training": lambda: run_training(ctx),
                "scaling": lambda: run_scaling(ctx, setup),
            }[name]
            ctx.stored[name] = runner()
        except jobs.JobError as err:
            failed.append(name)
            ctx.log(f"scenario {name} FAILED: {err}")
            continue
        ctx.log(f"scenario {name} done in {time.perf_counter() - t:.0f} s")
        save()  # after every scenario, so that a partial run still reports
    return failed


def quick_job(config: Dict[str, Any], say: Any = None) -> Dict[str, Any]:
    """--quick: every scenario's tiny variant in this one (uncapped) child process."""
    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    ctx = Context(True, config["workdir"], config["command"], log, {})
    failed = run_scenarios(ctx, config["scenarios"], lambda: None)
    return dict(stored=ctx.stored, failed=failed)


def _log(message: str) -> None:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%H:%M:%S")
    print(f"[{stamp}] {message}", flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    output = args.output or (tempfile.mkdtemp(prefix="memfit-bench-quick-")
                             if args.quick else HERE)
    os.makedirs(output, exist_ok=True)
    paths = {name: os.path.join(output, name)
             for name in ("RESULTS.md", "results.png", "results.json")}
    if args.quick and not os.path.exists(paths["RESULTS.md"]):
        # Start from the committed file, so that its hand-written notes are kept.
        committed = os.path.join(HERE, "RESULTS.md")
        if os.path.exists(committed):
            with open(committed) as f, open(paths["RESULTS.md"], "w") as g:
                g.write(f.read())

    stored: Dict[str, Any] = {}
    if os.path.exists(paths["results.json"]):
        with open(paths["results.json"]) as f:
            stored = json.load(f)

    def save() -> None:
        with open(paths["results.json"], "w") as f:
            json.dump(stored, f, indent=1)
        report.write_markdown(paths["RESULTS.md"], stored)
        if not args.no_plot:
            plot.write_plot(paths["results.png"], stored)

    if args.report_only:
        save()
        _log(f"regenerated {paths['RESULTS.md']} and {paths['results.png']}")
        return 0

    command = "python -m benchmarks.run" + (" " + " ".join(argv) if argv else "")
    workdir = tempfile.mkdtemp(prefix="memfit-bench-data-")
    if args.backend == "jax":
        ctx = Context(args.quick, workdir, command, _log, stored)
        _log(f"{command}: the overhead scenario on JAX, into {paths['RESULTS.md']}")
        try:
            stored["overhead_jax"] = run_overhead_jax(ctx, paths["RESULTS.md"])
        except jobs.JobError as err:
            _log(f"scenario overhead (JAX) FAILED: {err}")
            return 1
        with open(paths["results.json"], "w") as f:
            json.dump(stored, f, indent=1)
        return 0
    start = time.perf_counter()
    _log(f"{command}: writing into {output}")
    if args.quick:
        try:
            out = jobs.run_job("benchmarks.run:quick_job", dict(
                workdir=workdir, command=command, scenarios=args.scenarios), cap_mb=None,
                timeout=900)
        except jobs.JobError as err:
            _log(f"--quick run FAILED: {err}")
            return 1
        stored.update(out["stored"])
        failed = out["failed"]
    else:
        ctx = Context(False, workdir, command, _log, stored)
        failed = run_scenarios(ctx, args.scenarios, save)
    save()
    for row in report.summary_rows(stored):
        _log(f"{row['figure']}: ratio {row['ratio']} (target {row['target']}): "
             f"{'PASS' if row['ok'] else 'MISS'}")
    _log(f"wrote {paths['RESULTS.md']}, {paths['results.png']} and {paths['results.json']} "
         f"in {time.perf_counter() - start:.0f} s")
    if failed:
        _log(f"failed scenarios: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
