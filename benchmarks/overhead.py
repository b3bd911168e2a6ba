"""Overhead of `safe_predict` / `safe_evaluate` over Keras's own loops.

Acceptance criterion checked here: with no memory pressure,
`safe_predict(model, x, batch_size=B)` takes at most 5% more time than
`model.predict(x, batch_size=B)` at the same batch size, and likewise
`safe_evaluate` against `model.evaluate` (ratio of medians <= 1.05).

Method: for each model and batch size the sample count is calibrated so that
one `model.predict` call takes about `--target-seconds`; both paths are warmed
up (tracing, first-call caches) and their outputs compared, then the two
paths are timed in interleaved pairs, alternating which one goes first
(A B, B A, A B, ...), so that drift in the machine's load hits both alike.
Reported: median, min and max seconds per call of each path, the ratio of
the medians (the criterion) and the median of the per-pair ratios (a second
view, robust to slow drift). Timings on a shared machine are noisy; compare
ratios, not absolute times.

Usage (from the repository root):
    python -m benchmarks.overhead            # full run; rewrites its section
                                             # of benchmarks/RESULTS.md
    python -m benchmarks.overhead --quick    # seconds-long smoke run; writes
                                             # nothing unless --write is given
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Callable, Dict, List, Optional, Sequence, Tuple  # noqa: E402

import numpy as np  # noqa: E402

TARGET = 1.05
MIN_STEPS = 16  # calibration floor: a busy machine must not shrink a case to a few steps
SECTION_KEY = "overhead"
SECTION_TITLE = "Overhead with no memory pressure"
RESULTS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")
FILE_HEADER = """# keras_memfit benchmarks

Each `benchmark: KEY` section below is produced by one benchmark script and
regenerated independently: a script rewrites only the text between its own
`<!-- BEGIN benchmark: KEY -->` and `<!-- END benchmark: KEY -->` markers and
leaves the rest of this file alone (`notes: KEY` sections are written by hand
and never touched by a script). Timings come from shared, noisy machines; read
the ratios (measured side by side, interleaved), not the absolute times.
"""


# --------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------
def digit_cnn():
    """The Kaggle digit-recognizer CNN (28x28x1 -> 10 classes)."""
    import keras

    return keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.Conv2D(64, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(10, activation="softmax"),
        ],
        name="digit_cnn",
    )


def mlp():
    """A small MLP on flattened digits (784 -> 256 -> 128 -> 10)."""
    import keras

    return keras.Sequential(
        [
            keras.Input((784,)),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ],
        name="mlp",
    )


MODELS: Dict[str, Tuple[Callable, Tuple[int, ...]]] = {
    "digit_cnn": (digit_cnn, (28, 28, 1)),
    "mlp": (mlp, (784,)),
}


def build(name: str):
    factory, _ = MODELS[name]
    model = factory()
    model.compile(
        optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"]
    )
    return model


def make_data(name: str, n: int, seed: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    _, shape = MODELS[name]
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n,) + shape, dtype=np.float32)
    y = rng.integers(0, 10, size=n).astype("int32")
    return x, y


# --------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------
@dataclasses.dataclass
class Result:
    model: str
    call: str  # "predict" or "evaluate"
    batch_size: int
    samples: int
    repeats: int
    keras_times: List[float]
    memfit_times: List[float]

    @property
    def steps(self) -> int:
        return -(-self.samples // self.batch_size)

    @property
    def keras_median(self) -> float:
        return statistics.median(self.keras_times)

    @property
    def memfit_median(self) -> float:
        return statistics.median(self.memfit_times)

    @property
    def ratio(self) -> float:
        """Ratio of the medians: the acceptance criterion."""
        return self.memfit_median / self.keras_median

    @property
    def paired_ratio(self) -> float:
        """Median over the interleaved pairs of memfit time / Keras time."""
        return statistics.median(m / k for m, k in zip(self.memfit_times, self.keras_times))

    @property
    def per_step_overhead_ms(self) -> float:
        return (self.memfit_median - self.keras_median) / self.steps * 1e3

    @property
    def passed(self) -> bool:
        return self.ratio <= TARGET


def _timed(fn: Callable[[], object]) -> float:
    gc.collect()  # outside the timed region, so neither path pays the other's garbage
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleave(
    keras_fn: Callable[[], object], memfit_fn: Callable[[], object], repeats: int
) -> Tuple[List[float], List[float]]:
    """Time both paths `repeats` times each, in pairs alternating who goes first."""
    keras_times: List[float] = []
    memfit_times: List[float] = []
    for r in range(repeats):
        if r % 2 == 0:
            keras_times.append(_timed(keras_fn))
            memfit_times.append(_timed(memfit_fn))
        else:
            memfit_times.append(_timed(memfit_fn))
            keras_times.append(_timed(keras_fn))
    return keras_times, memfit_times


def calibrate_samples(
    model, name: str, batch_size: int, target_seconds: float, max_samples: int
) -> int:
    """Samples (a multiple of `batch_size`) for one `model.predict` of ~target_seconds.

    At least `MIN_STEPS` batches, so per-call costs do not dominate a case.
    """
    probe_steps = 16 if batch_size >= 128 else 64
    x, _ = make_data(name, probe_steps * batch_size, seed=1)
    model.predict(x, batch_size=batch_size, verbose=0)  # trace
    seconds = min(
        _timed(lambda: model.predict(x, batch_size=batch_size, verbose=0)) for _ in range(3)
    )
    steps = max(MIN_STEPS, round(target_seconds / seconds * probe_steps))
    return min(steps * batch_size, max(batch_size, max_samples // batch_size * batch_size))


def run_case(
    name: str,
    batch_size: int,
    *,
    samples: Optional[int],
    repeats: int,
    warmup: int,
    target_seconds: float,
    max_samples: int,
    calls: Sequence[str],
    log: Callable[[str], None],
) -> List[Result]:
    import keras
    from keras_memfit import safe_evaluate, safe_predict

    keras.utils.clear_session()
    model = build(name)
    if samples is None:
        samples = calibrate_samples(model, name, batch_size, target_seconds, max_samples)
    x, y = make_data(name, samples)

    paths: Dict[str, Tuple[Callable, Callable, Callable]] = {
        "predict": (
            lambda: model.predict(x, batch_size=batch_size, verbose=0),
            lambda: safe_predict(model, x, batch_size=batch_size, verbose=0),
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
        ),
        "evaluate": (
            lambda: model.evaluate(x, y, batch_size=batch_size, verbose=0),
            lambda: safe_evaluate(model, x, y, batch_size=batch_size, verbose=0),
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
        ),
    }
    results = []
    for call in calls:
        keras_fn, memfit_fn, check = paths[call]
        for _ in range(warmup):
            expected = keras_fn()
            got = memfit_fn()
        check(expected, got)  # same work on both sides, or the ratio means nothing
        keras_times, memfit_times = interleave(keras_fn, memfit_fn, repeats)
        result = Result(name, call, batch_size, samples, repeats, keras_times, memfit_times)
        results.append(result)
        log(
            f"{name:<10} {call:<9} batch={batch_size:<5} samples={samples:<7} "
            f"keras={result.keras_median:.4f}s memfit={result.memfit_median:.4f}s "
            f"ratio={result.ratio:.3f} paired={result.paired_ratio:.3f} "
            f"{'PASS' if result.passed else 'FAIL'}"
        )
    return results


# --------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> Dict[str, str]:
    import keras
    import tensorflow as tf

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    try:
        load = " / ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        load = "n/a"
    devices = ", ".join(d.name.replace("/physical_device:", "") for d in
                        tf.config.list_physical_devices())
    return {
        "Date (UTC)": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "CPU": _cpu_model(),
        "CPU count (usable / total)": f"{usable} / {os.cpu_count()}",
        "Load average at start (1/5/15 min)": load,
        "Devices seen by TensorFlow": devices,
        "Python": platform.python_version(),
        "TensorFlow": tf.__version__,
        "Keras": keras.__version__,
        "NumPy": np.__version__,
        "OS": platform.platform(),
    }


def _span(times: List[float]) -> str:
    return f"{statistics.median(times):.3f} ({min(times):.3f}-{max(times):.3f})"


def results_table(results: Sequence[Result]) -> str:
    lines = [
        "| Model | Call | Batch | Samples (steps) | Repeats | Keras s: median (min-max) "
        "| keras_memfit s: median (min-max) | Ratio of medians | Median paired ratio "
        "| Extra ms/step | <= 1.05 |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.model} | {r.call} | {r.batch_size} | {r.samples} ({r.steps}) | "
            f"{r.repeats} | {_span(r.keras_times)} | {_span(r.memfit_times)} | "
            f"**{r.ratio:.3f}** | {r.paired_ratio:.3f} | {r.per_step_overhead_ms:+.3f} | "
            f"{'pass' if r.passed else 'FAIL'} |"
        )
    return "\n".join(lines)


def section_markdown(results: Sequence[Result], info: Dict[str, str], argv: List[str],
                     end_load: str) -> str:
    failed = [r for r in results if not r.passed]
    verdict = (
        f"**Target ratio <= {TARGET} holds in all {len(results)} cases.**"
        if not failed else
        f"**Target ratio <= {TARGET} fails in {len(failed)} of {len(results)} cases** "
        f"(worst: {max(results, key=lambda r: r.ratio).ratio:.3f}, "
        f"{max(results, key=lambda r: r.ratio).model} "
        f"{max(results, key=lambda r: r.ratio).call} batch "
        f"{max(results, key=lambda r: r.ratio).batch_size})."
    )
    command = "python -m benchmarks.overhead" + ("" if not argv else " " + " ".join(argv))
    machine = "\n".join(f"| {k} | {v} |" for k, v in info.items())
    return f"""## {SECTION_TITLE}

Generated by `{command}`.

Claim: with no memory pressure, `safe_predict(model, x, batch_size=B)` costs at
most 5% more time than `model.predict(x, batch_size=B)`, and `safe_evaluate`
at most 5% more than `model.evaluate` (ratio of medians <= {TARGET}).

Method: numpy inputs (random data, the same arrays for both paths), `verbose=0`,
compiled models (adam, sparse categorical cross-entropy, accuracy). The sample
count is calibrated so one `model.predict` call takes about a second (at least
{MIN_STEPS} batches). Both paths are warmed up and their outputs checked equal,
then timed in interleaved pairs, alternating which goes first; `gc.collect()`
runs before each timed call, outside the timing. "Extra ms/step" is (memfit
median - Keras median) / steps. The machine is shared with other jobs, so
absolute times move between runs; the ratios are the result.

| Machine | |
|---|---|
{machine}
| Load average at end (1/5/15 min) | {end_load} |

{results_table(results)}

{verdict}
"""


def update_section(path: str, key: str, body: str) -> None:
    """Replace (or append) the text between `key`'s markers in `path`."""
    begin, end = f"<!-- BEGIN benchmark: {key} -->", f"<!-- END benchmark: {key} -->"
    block = f"{begin}\n{body.strip()}\n{end}"
    text = FILE_HEADER
    if os.path.exists(path):
        with open(path) as f:
            text = f.read()
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    with open(path, "w") as f:
        f.write(text)


# --------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------
def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.overhead",
        description="Time safe_predict/safe_evaluate against model.predict/evaluate.",
    )
    parser.add_argument("--quick", action="store_true",
                        help="tiny smoke run (a few seconds); writes nothing unless --write")
    parser.add_argument("--write", action="store_true",
                        help="write the results section even with --quick")
    parser.add_argument("--no-write", action="store_true", help="never write RESULTS.md")
    parser.add_argument("--output", default=RESULTS_PATH, help="results file to update")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS),
                        default=["digit_cnn", "mlp"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[32, 256])
    parser.add_argument("--calls", nargs="+", choices=["predict", "evaluate"],
                        default=["predict", "evaluate"])
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed calls per path and case (default 15, 2 with --quick)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per path first")
    parser.add_argument("--target-seconds", type=float, default=1.0,
                        help="calibrate samples so one model.predict takes about this long")
    parser.add_argument("--samples", type=int, default=None,
                        help="fixed sample count instead of calibrating")
    parser.add_argument("--max-samples", type=int, default=200_000)
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when a ratio exceeds the target (off by default: "
                             "timings on shared machines are not a pass/fail test)")
    args = parser.parse_args(argv)
    if args.quick:
        if args.repeats is None:
            args.repeats = 2
        if args.samples is None:
            args.samples = 64
        args.warmup = min(args.warmup, 1)
        if args.batch_sizes == [32, 256]:
            args.batch_sizes = [32]
    if args.repeats is None:
        args.repeats = 15
    if args.repeats < 1 or args.warmup < 1:
        parser.error("--repeats and --warmup must be at least 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)

    def log(message: str) -> None:
        print(message, flush=True)

    info = machine_info()
    log("machine: " + "; ".join(f"{k}: {v}" for k, v in info.items()))
    results: List[Result] = []
    for name in args.models:
        for batch_size in args.batch_sizes:
            results.extend(run_case(
                name, batch_size,
                samples=args.samples, repeats=args.repeats, warmup=args.warmup,
                target_seconds=args.target_seconds, max_samples=args.max_samples,
                calls=args.calls, log=log,
            ))
    try:
        end_load = " / ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        end_load = "n/a"

    print()
    print(results_table(results))
    print()
    for r in results:
        print(f"ratio {r.model} {r.call} batch={r.batch_size}: {r.ratio:.3f} "
              f"({'pass' if r.passed else 'FAIL'} vs {TARGET})")

    write = not args.no_write and (args.write or not args.quick)
    if write:
        update_section(args.output, SECTION_KEY, section_markdown(results, info, argv, end_load))
        print(f"\nwrote section '{SECTION_KEY}' of {args.output}")
    if args.check and any(not r.passed for r in results):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
