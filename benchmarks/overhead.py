"""Overhead of `safe_predict` / `safe_evaluate` / `MemFit` over Keras's own loops.

Acceptance criteria checked here, with no memory pressure:
`safe_predict(model, x, batch_size=B)` takes at most 5% more time than
`model.predict(x, batch_size=B)` at the same batch size, and likewise
`safe_evaluate` against `model.evaluate` (ratio of medians <= 1.05);
`model.fit(..., callbacks=[MemFit()])` takes at most 2% more time than the
same `model.fit` without the callback (ratio of medians <= 1.02).

Method: for each model and batch size the sample count is calibrated so that
one `model.predict` call (for the "fit" call: one plain `model.fit` epoch)
takes about `--target-seconds` (at least `MIN_STEPS` batches), on random
numpy inputs, the same arrays for both paths, `verbose=0`; both paths are
warmed up (tracing, first-call caches) and their outputs compared (fit:
losses, metrics, final weights, and that MemFit ran its own train step
without adapting), then the two paths are timed
in interleaved pairs, alternating which one goes first (A B, B A, A B, ...),
so that drift in the machine's load hits both alike. Before every "fit" call,
warm-up or timed, the model's weights and optimizer variables are reset to
the same initial values (untimed), so both paths train the same steps from
the same state; `shuffle=False`, one epoch, a new `MemFit()` per call.
`gc.collect()` runs before each timed call, outside the timing, with what
existed before a case frozen out of the collector's view (`gc.freeze()`).
Reported: median, min and max seconds per call of each path, the ratio of
the medians (the criterion), a 95% bootstrap interval around it over the
pairs (how far the run's noise reaches) and the median of the per-pair
ratios (a second view, robust to slow drift). Verdict per case
(`benchmarks.common.ratio_verdict`): pass where the ratio of medians meets
the target; "pass, within noise" where it does not but the interval's lower
bound does; FAIL only where the whole interval lies above the target.
Timings on a shared machine are noisy; compare ratios, not absolute times.

Usage (from the repository root):
    python -m benchmarks.overhead            # full run; rewrites its section
                                             # of benchmarks/RESULTS.md
    python -m benchmarks.overhead --quick    # seconds-long smoke run; writes
                                             # nothing unless --write is given
    KERAS_BACKEND=jax python -m benchmarks.overhead   # the same on JAX (no
                                             # TensorFlow needed); its own
                                             # section, "overhead-jax"
    KERAS_BACKEND=torch python -m benchmarks.overhead # on torch: "overhead-torch"
    KERAS_BACKEND=torch python -m benchmarks.overhead --from-json benchmarks/overhead_torch.json
                                             # that section again from the timings
                                             # its run saved (--json), timing nothing
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple  # noqa: E402

import numpy as np  # noqa: E402

from benchmarks.common import OVERHEAD_CALLS as CALLS  # noqa: E402
from benchmarks.common import OVERHEAD_TARGETS as TARGETS  # noqa: E402
from benchmarks.common import BOOTSTRAP_RESAMPLES, OVERHEAD_CONFIDENCE, VERDICT_RULE  # noqa: E402
from benchmarks.common import (  # noqa: E402
    Result,
    cpu_model,
    load_average,
    machine_line,
    now_utc,
    results_table,
    usable_cpus,
    verdicts,
    versions,
    write_section,
)

MIN_STEPS = 16  # calibration floor: a busy machine must not shrink a case to a few steps
SECTION_KEY = "overhead"
SECTION_TITLE = "Overhead with no memory pressure"
JAX_SECTION_KEY = "overhead-jax"  # KERAS_BACKEND=jax writes its own section
JAX_SECTION_TITLE = "Overhead with no memory pressure, JAX backend"
TORCH_SECTION_KEY = "overhead-torch"  # KERAS_BACKEND=torch too
TORCH_SECTION_TITLE = "Overhead with no memory pressure, PyTorch backend"


def section_key_and_title() -> Tuple[str, str]:
    """The RESULTS.md section of the active Keras backend (JAX and torch have their own)."""
    if os.environ.get("KERAS_BACKEND") == "torch":
        return TORCH_SECTION_KEY, TORCH_SECTION_TITLE
    if os.environ.get("KERAS_BACKEND") == "jax":
        return JAX_SECTION_KEY, JAX_SECTION_TITLE
    return SECTION_KEY, SECTION_TITLE
RESULTS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")


# --------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------
def digit_cnn():
    """The Kaggle digit-recognizer CNN (28x28x1 -> 10 classes), as in the demo."""
    from keras_memfit.app.demo import build_cnn

    return build_cnn()


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
def _timed(fn: Callable[[], object], setup: Optional[Callable[[], object]] = None) -> float:
    if setup is not None:
        setup()  # untimed: e.g. reset the weights before a fit
    gc.collect()  # outside the timed region, so neither path pays the other's garbage
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleave(
    keras_fn: Callable[[], object], memfit_fn: Callable[[], object], repeats: int,
    setup: Optional[Callable[[], object]] = None,
) -> Tuple[List[float], List[float]]:
    """Time both paths `repeats` times each, in pairs alternating who goes first.

    `setup` runs before every timed call, outside the timing.
    """
    keras_times: List[float] = []
    memfit_times: List[float] = []
    for r in range(repeats):
        if r % 2 == 0:
            keras_times.append(_timed(keras_fn, setup))
            memfit_times.append(_timed(memfit_fn, setup))
        else:
            memfit_times.append(_timed(memfit_fn, setup))
            keras_times.append(_timed(keras_fn, setup))
    return keras_times, memfit_times


class TrainState:
    """The model's weights and optimizer variables, to start every fit alike.

    Builds the optimizer first, so that its slots and iteration counter exist
    and are part of the state (fit resets the metrics itself).
    """

    def __init__(self, model) -> None:
        if model.optimizer is not None and not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        self._model = model
        self._weights = model.get_weights()
        self._optimizer = [v.numpy() for v in model.optimizer.variables]

    def restore(self) -> None:
        self._model.set_weights(self._weights)
        for v, value in zip(self._model.optimizer.variables, self._optimizer):
            v.assign(value)


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


def calibrate_fit_samples(
    model, name: str, batch_size: int, target_seconds: float, max_samples: int,
    state: TrainState,
) -> int:
    """Samples (a multiple of `batch_size`) for one plain `model.fit` epoch of ~target_seconds.

    At least `MIN_STEPS` batches. Leaves the model in `state`.
    """
    probe_steps = 8 if batch_size >= 128 else 32
    x, y = make_data(name, probe_steps * batch_size, seed=1)

    def fit():
        model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)

    state.restore()
    fit()  # trace
    seconds = min(_timed(fit, state.restore) for _ in range(2))
    state.restore()
    steps = max(MIN_STEPS, round(target_seconds / seconds * probe_steps))
    return min(steps * batch_size, max(batch_size, max_samples // batch_size * batch_size))


def _step_watcher():
    """A callback (put after MemFit) counting the steps run by a keras_memfit train function.

    Keras is imported here, not at module level: the job sets the allocator's
    environment before TensorFlow starts.
    """
    import keras

    class StepWatcher(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.memfit_steps = 0

        def on_train_batch_begin(self, batch, logs=None):
            # `_model`: on JAX, `Callback.model` makes Keras sync its state first.
            module = getattr(self._model.train_function, "__module__", "") or ""
            self.memfit_steps += module.startswith("keras_memfit.")

    return StepWatcher()


def _check_fit(expected, got) -> None:
    """Same losses, metrics and final weights from both fits; MemFit ran its own step."""
    (keras_history, keras_weights), (memfit_history, memfit_weights) = expected, got
    history, memfit, watcher = memfit_history
    if watcher.memfit_steps == 0:
        raise AssertionError("MemFit did not run its own train step during fit")
    if memfit.events:
        raise AssertionError(f"MemFit adapted with no memory pressure: {memfit.events}")
    for key, values in keras_history.history.items():
        np.testing.assert_allclose(values, history.history[key], rtol=1e-3, atol=1e-5)
    for a, b in zip(keras_weights, memfit_weights):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4)


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

    from keras_memfit import MemFit, safe_evaluate, safe_predict

    keras.utils.clear_session()
    model = build(name)
    state = TrainState(model)  # the initial weights every fit starts from
    counts: Dict[str, int] = {}
    if "predict" in calls or "evaluate" in calls:
        counts["infer"] = samples or calibrate_samples(
            model, name, batch_size, target_seconds, max_samples
        )
    if "fit" in calls:
        counts["fit"] = samples or calibrate_fit_samples(
            model, name, batch_size, target_seconds, max_samples, state
        )
    data = {kind: make_data(name, n) for kind, n in counts.items()}

    def predict_paths():
        x, _ = data["infer"]
        return (
            lambda: model.predict(x, batch_size=batch_size, verbose=0),
            lambda: safe_predict(model, x, batch_size=batch_size, verbose=0),
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
            None, None,
        )

    def evaluate_paths():
        x, y = data["infer"]
        return (
            lambda: model.evaluate(x, y, batch_size=batch_size, verbose=0),
            lambda: safe_evaluate(model, x, y, batch_size=batch_size, verbose=0),
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
            None, None,
        )

    def fit_paths():
        x, y = data["fit"]

        def keras_fit():
            return model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)

        def memfit_fit():
            memfit, watcher = MemFit(), _step_watcher()
            history = model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False,
                                verbose=0, callbacks=[memfit, watcher])
            return history, memfit, watcher

        def memfit_fit_timed():  # as a user writes it: no watcher
            return model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False,
                             verbose=0, callbacks=[MemFit()])

        return (keras_fit, memfit_fit, _check_fit, state.restore, model.get_weights,
                memfit_fit_timed)

    paths = {"predict": predict_paths, "evaluate": evaluate_paths, "fit": fit_paths}
    results = []
    for call in calls:
        # The checked MemFit path may watch it; the timed one is as a user writes it.
        keras_fn, memfit_fn, check, setup, capture, *timed = paths[call]()
        timed_fn = timed[0] if timed else memfit_fn
        n = counts["fit" if call == "fit" else "infer"]
        for _ in range(warmup):
            if setup:
                setup()
            expected = keras_fn()
            if capture:
                expected = (expected, capture())
            if setup:
                setup()
            got = memfit_fn()
            if capture:
                got = (got, capture())
        check(expected, got)  # same work on both sides, or the ratio means nothing
        del expected, got
        # What exists now (models, traced graphs, caches) is set aside from the
        # garbage collector, so the gc.collect() before each timed call scans
        # only what the timed calls made: under 1 ms instead of 0.15-0.2 s here.
        gc.collect()
        gc.freeze()
        try:
            keras_times, memfit_times = interleave(keras_fn, timed_fn, repeats, setup)
        finally:
            gc.unfreeze()
        if setup:
            setup()
        result = Result(name, call, batch_size, n, repeats, keras_times, memfit_times)
        results.append(result)
        log(
            f"{name:<10} {call:<9} batch={batch_size:<5} samples={n:<7} "
            f"keras={result.keras_median:.4f}s memfit={result.memfit_median:.4f}s "
            f"ratio={result.ratio:.3f} ({result.interval_text}) "
            f"paired={result.paired_ratio:.3f} {result.verdict}"
        )
    return results


# --------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------
def machine_info() -> Dict[str, str]:
    """The machine and versions this process runs on (imports the Keras backend)."""
    seen = versions()
    devices = next(key for key in seen if key.startswith("Devices seen by"))
    return {
        "Date (UTC)": now_utc(),
        "CPU": cpu_model(),
        "CPU count (usable / total)": usable_cpus(),
        "Load average at start (1/5/15 min)": load_average(),
        devices: seen.pop(devices),
        **seen,
        "OS": platform.platform(),
    }


def section_markdown(results: Sequence[Result], info: Dict[str, str], argv: List[str],
                     end_load: str) -> str:
    verdict = verdicts(results)
    command = "python -m benchmarks.overhead" + ("" if not argv else " " + " ".join(argv))
    machine = machine_line({**info, "Load average at end (1/5/15 min)": end_load})
    title = section_key_and_title()[1]
    return f"""## {title}

Generated by `{command}`. Target, with no memory pressure: `safe_predict` and
`safe_evaluate` at most 5% slower than `model.predict` and `model.evaluate`
(ratio of medians <= {TARGETS["evaluate"]}), `fit` with `MemFit()` at most 2% slower than
without it (<= {TARGETS["fit"]}). Method: `benchmarks/overhead.py`'s docstring (random
numpy inputs, about a second per call, outputs checked equal, interleaved
pairs); "Extra ms/step" is (memfit median - Keras median) / steps. The
{OVERHEAD_CONFIDENCE:.0%} interval is a percentile bootstrap of the ratio of medians over the
pairs ({BOOTSTRAP_RESAMPLES:,} resamples, fixed seed): how far this run's noise reaches.
{VERDICT_RULE}

{machine}

{results_table(results)}

{verdict}
"""


# --------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------
def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.overhead",
        description="Time safe_predict/safe_evaluate/MemFit against "
                    "model.predict/evaluate/fit.",
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
    parser.add_argument("--calls", nargs="+", choices=list(CALLS), default=list(CALLS))
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed calls per path and case (default 15, 2 with --quick)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per path first")
    parser.add_argument("--target-seconds", type=float, default=1.0,
                        help="calibrate samples so one model.predict (for fit: one plain "
                             "model.fit epoch) takes about this long")
    parser.add_argument("--samples", type=int, default=None,
                        help="fixed sample count instead of calibrating")
    parser.add_argument("--max-samples", type=int, default=200_000)
    parser.add_argument("--json", default=None,
                        help="also write the raw timings to this JSON file "
                             "(used by python -m benchmarks.run)")
    parser.add_argument("--from-json", default=None, metavar="PATH",
                        help="time nothing: rebuild this backend's section from the timings "
                             "a run saved with --json (its command, machine and loads too)")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when a case fails: its whole interval above the target "
                             "(off by default: timings on shared machines are not a "
                             "pass/fail test)")
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


def saved_backend(info: Dict[str, str]) -> Optional[str]:
    """The Keras backend whose devices a run's machine info lists (see `versions`)."""
    names = {"Devices seen by TensorFlow": "tensorflow", "Devices seen by JAX": "jax",
             "Devices seen by torch": "torch"}
    return next((names[key] for key in info if key in names), None)


def load_json(path: str) -> Tuple[List[Result], Dict[str, str], List[str], str]:
    """The results, machine, command line and end load that a run saved with `--json`.

    The command line is the run's own, less its `--json` and `--from-json`
    options (they name files, not how the timings were taken).
    """
    import json

    with open(path) as f:
        saved = json.load(f)
    argv: List[str] = []
    words = iter(saved.get("argv", []))
    for word in words:
        if word in ("--json", "--from-json"):
            next(words, None)
        elif not word.startswith(("--json=", "--from-json=")):
            argv.append(word)
    return ([Result(**case) for case in saved["cases"]], saved["machine"], argv,
            saved.get("end_load", "n/a"))


def job(config: Dict[str, Any], say: Any = None) -> Dict[str, Any]:
    """`main(config["args"])` as a `benchmarks.jobs.run_job` target (in a fresh process)."""
    return {"exit_code": main(list(config["args"]))}


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)

    def log(message: str) -> None:
        print(message, flush=True)

    if args.from_json:
        results, info, argv, end_load = load_json(args.from_json)
        saved = saved_backend(info)
        if saved != os.environ.get("KERAS_BACKEND"):
            print(f"error: --from-json {args.from_json} holds timings taken on the {saved} "
                  f"backend; received KERAS_BACKEND={os.environ.get('KERAS_BACKEND')}. Run it "
                  f"with KERAS_BACKEND={saved}, so that the right section is rewritten.",
                  file=sys.stderr)
            return 2
    else:
        info = machine_info()
        log("machine: " + "; ".join(f"{k}: {v}" for k, v in info.items()))
        results = []
        for name in args.models:
            for batch_size in args.batch_sizes:
                results.extend(run_case(
                    name, batch_size,
                    samples=args.samples, repeats=args.repeats, warmup=args.warmup,
                    target_seconds=args.target_seconds, max_samples=args.max_samples,
                    calls=args.calls, log=log,
                ))
        end_load = load_average()

    print()
    print(results_table(results))
    print()
    for r in results:
        print(f"ratio {r.model} {r.call} batch={r.batch_size}: {r.ratio:.3f} "
              f"({OVERHEAD_CONFIDENCE:.0%} interval {r.interval_text}): {r.verdict} "
              f"vs {r.target}")

    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump({"cases": [dataclasses.asdict(r) for r in results], "machine": info,
                       "argv": argv, "end_load": end_load}, f)
    write = not args.no_write and (args.write or not args.quick)
    if write:
        key = section_key_and_title()[0]
        write_section(args.output, key, section_markdown(results, info, argv, end_load))
        print(f"\nwrote section '{key}' of {args.output}")
    if args.check and any(not r.passed for r in results):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
