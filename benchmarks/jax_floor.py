"""Where MemFit's time per training step goes on JAX, against Keras's own step.

MemFit's fit overhead (`benchmarks/overhead.py`) is one number. This splits it,
timing three loops over the same batches in one process, interleaved:

- "Keras's step": Keras's compiled train step (`jax.jit(model.train_step,
  donate_argnums=0)`, as `make_train_function` compiles it), called on Keras's
  state tuple batch after batch, never waited for until the end, as Keras's
  loop calls it. The reference.
- "keras_memfit's step": keras_memfit's `TrainStep` on the same state tuple
  (inside `state.threaded`, as in MemFit's train function): its gradient
  program (donating nothing), waited for, then its update program (in place,
  not waited for). MemFit's steady state without Keras's loop or MemFit's
  bookkeeping. What it costs over the reference is what keeping the state
  through an OOM costs: the wait for the gradient program before the update
  may donate the state, and one more dispatch per step.
- `model.fit` with `callbacks=[MemFit()]` against the same `model.fit` without:
  everything, as `benchmarks/overhead.py` measures it.

Three models: the overhead benchmark's CNN (a step of several milliseconds
on this CPU: the target there is MemFit's fit within 1.02x of Keras's), its
MLP (784-256-128-10, adam) and a tiny Dense(1) model, whose step is almost
all host time (the case of a small model on a GPU, where the host dispatches
and the device waits: the target there is at most 30 us added per step).
Reported per loop: median seconds, the ratio of medians to its reference,
and the extra microseconds per step, in wall time and in the main thread's
CPU time (host time, which a loaded machine stretches far less), and issue
#20's verdict on `model.fit + MemFit`, judged by plain `model.fit`'s time
per step. Then MemFit's own host time per batch, by layer (`own_time`): the
tiny model's `fit` with MemFit, its step made a no-op, with timers around
each layer of MemFit's per-batch path (issue #38, item 4: at most 20 us).
The CNN runs 20 steps a loop by default (about 0.27 s a step on JAX's CPU
client here), the others 1,000.

Usage (from the repository root; JAX needed, TensorFlow not):
    python -m benchmarks.jax_floor            # full run; writes its section
                                              # of benchmarks/RESULTS.md
    python -m benchmarks.jax_floor --quick    # seconds-long smoke run; writes
                                              # nothing unless --write is given
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple  # noqa: E402

import numpy as np  # noqa: E402

from benchmarks import common  # noqa: E402

KEY = "jax-floor"
MODELS = ("cnn", "mlp", "tiny")
BATCH = {"cnn": 64, "mlp": 32, "tiny": 8}
# Steps per loop by default: the CNN's step takes about 0.145 s on JAX's CPU
# client, so 1,000 of them a loop (36 loops a run) would take hours.
STEPS = {"cnn": 20, "mlp": 1000, "tiny": 1000}
QUICK_STEPS = 20
# Issue #20, item 5: where plain fit's step takes this long or more, MemFit's
# fit is judged by its ratio (<= FIT_RATIO), else by the host time it adds
# per step (<= HOST_US).
LONG_STEP_S = 2e-3
FIT_RATIO = 1.02
HOST_US = 30.0
# Issue #38, item 4: MemFit's own host time outside its two-program step
# (`own_time`) at most this many microseconds a step on the tiny model.
OWN_US = 20.0
# `own_time`'s batches per fit (the tiny model) in a full run.
OWN_STEPS = 2000
# MemFit's own layers per batch, as `own_time` reports them.
OWN_LAYERS = {
    "begin": "`MemFit.on_train_batch_begin` (puts MemFit's train function in place)",
    "function": "MemFit's train function, less Keras's iterator and `Run.train` "
                "(the state tuple threaded and published, the function removed)",
    "run": "`Run.train`, less the step (the cut, the remat check, the planner, `run_whole`)",
}
OVERHEAD_MODELS = {"cnn": "digit_cnn", "mlp": "mlp"}  # their names in benchmarks/overhead


def _model(name: str):
    import keras

    from benchmarks.overhead import build

    keras.utils.set_random_seed(0)
    if name in OVERHEAD_MODELS:
        return build(OVERHEAD_MODELS[name])
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    return model


def _data(name: str, steps: int) -> Tuple[np.ndarray, np.ndarray]:
    from benchmarks.overhead import make_data

    n = steps * BATCH[name]
    if name in OVERHEAD_MODELS:
        return make_data(OVERHEAD_MODELS[name], n)
    rng = np.random.default_rng(0)
    return rng.random((n, 4), dtype=np.float32), rng.random((n, 1), dtype=np.float32)


def _timer() -> Tuple[float, float]:
    """Wall time and this thread's CPU time (the host time the Python loop spends)."""
    return time.perf_counter(), time.thread_time()


def _since(start: Tuple[float, float]) -> Tuple[float, float]:
    wall, cpu = _timer()
    return wall - start[0], cpu - start[1]


def _loops(name: str, steps: int) -> Tuple[Callable[[], None],
                                           Dict[str, Callable[[], Tuple[float, float]]]]:
    """A check that the two step loops agree, and the timed loops of one model."""
    import jax
    import jax.numpy as jnp

    from keras_memfit import MemFit
    from keras_memfit.backend.jax import state as state_lib
    from keras_memfit.backend.jax import training

    x, y = _data(name, steps)
    model = _model(name)
    b = BATCH[name]
    model.fit(x[:b], y[:b], batch_size=b, verbose=0)  # builds the optimizer and metrics
    # Copies: the fits below donate the variables' own arrays (Keras's step and
    # MemFit's update program both work in place).
    initial = [[jnp.copy(a) for a in state_lib.read(state_lib.variables(model, group))]
               for group in state_lib.GROUPS["train"]]
    batches = [(jnp.asarray(x[i:i + b]), jnp.asarray(y[i:i + b])) for i in range(0, len(x), b)]
    keras_step = jax.jit(model.train_step, donate_argnums=0)
    memfit_step = training.TrainStep(model)

    finals: Dict[str, list] = {}  # each step loop's last trainable weights

    def fresh_state() -> tuple:
        return tuple([jnp.copy(a) for a in group] for group in initial)

    def keras_loop() -> Tuple[float, float]:
        state = fresh_state()
        jax.block_until_ready(state)
        start = _timer()
        for batch in batches:
            _, state = keras_step(state, batch)
        jax.block_until_ready(state)
        seconds = _since(start)
        finals["keras"] = state[0]
        return seconds

    def memfit_loop() -> Tuple[float, float]:
        state = fresh_state()
        jax.block_until_ready(state)
        start = _timer()
        with state_lib.threaded(model, "train", state) as call:
            for batch in batches:
                memfit_step(batch)
            state = call.finish()
            jax.block_until_ready(state)
        seconds = _since(start)
        finals["memfit"] = state[0]
        return seconds

    def check() -> None:
        """Both step loops trained the same weights (run after each has run once)."""
        for got, expected in zip(finals["memfit"], finals["keras"]):
            np.testing.assert_allclose(np.asarray(got), np.asarray(expected),
                                       rtol=1e-4, atol=1e-6)

    def fit(callbacks: Callable[[], list]) -> Callable[[], Tuple[float, float]]:
        def run() -> Tuple[float, float]:
            start = _timer()
            model.fit(x, y, batch_size=b, epochs=1, shuffle=False, verbose=0,
                      callbacks=callbacks())
            return _since(start)
        return run

    return check, {
        "Keras's step": keras_loop,
        "keras_memfit's step": memfit_loop,
        "model.fit": fit(list),
        "model.fit + MemFit": fit(lambda: [MemFit()]),
    }


REFERENCE = {"keras_memfit's step": "Keras's step", "model.fit + MemFit": "model.fit"}


def measure(name: str, steps: int, repeats: int) -> List[Tuple[str, float, float, float, float]]:
    """Rows of (loop, median seconds, ratio to its reference, extra us/step, extra host CPU us/step).

    The host CPU is the main thread's CPU time (`time.thread_time`): the
    Python each loop runs, the dispatches and waits, not the time other
    processes take the cores (a loaded machine stretches wall time, barely
    this). XLA's CPU client may run small programs on this thread too.
    """
    check, loops = _loops(name, steps)
    for loop in loops.values():  # warm-up: compilation, first-call caches
        loop()
    check()
    times: Dict[str, List[Tuple[float, float]]] = {label: [] for label in loops}
    order = list(loops)
    for r in range(repeats):
        for label in order if r % 2 == 0 else order[::-1]:
            gc.collect()
            times[label].append(loops[label]())
    medians = {label: float(np.median([w for w, _ in t])) for label, t in times.items()}
    cpus = {label: float(np.median([c for _, c in t])) for label, t in times.items()}
    rows = []
    for label in loops:
        ref = REFERENCE.get(label, label)
        extra = (medians[label] - medians[ref]) / steps * 1e6
        extra_cpu = (cpus[label] - cpus[ref]) / steps * 1e6
        rows.append((label, medians[label], medians[label] / medians[ref], extra, extra_cpu))
    return rows


@contextlib.contextmanager
def _timed_layers(totals: Dict[str, float]) -> Iterator[None]:
    """Within the block, MemFit's per-batch layers add their seconds to `totals`.

    Timed: `MemFit.on_train_batch_begin` ("begin"), the train function
    MemFit installs ("installed"), `Run.train` ("run"), Keras's iterator as
    MemFit's function pulls from it ("next") and the step ("step"), which is
    made a no-op returning fixed logs, so that only MemFit's own Python is
    left once the iterator is subtracted.
    """
    from keras_memfit import callbacks
    from keras_memfit._internal import batches
    from keras_memfit.backend.jax import training
    from keras_memfit.training import run

    def timed(name: str, function: Callable) -> Callable:
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                totals[name] += time.perf_counter() - start
        return wrapper

    logs = {"loss": np.float32(0.0)}
    build = callbacks.MemFit._build
    patches = [
        (callbacks.MemFit, "on_train_batch_begin",
         timed("begin", callbacks.MemFit.on_train_batch_begin)),
        (callbacks.MemFit, "_build",
         lambda self, *args: timed("installed", build(self, *args))),
        (run.Run, "train", timed("run", run.Run.train)),
        (batches, "pull_batches", timed("next", batches.pull_batches)),
        (training.TrainStep, "__call__", timed("step", lambda self, data: logs)),
    ]
    originals = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]
    try:
        for owner, name, patched in patches:
            setattr(owner, name, patched)
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


def own_time(steps: int, repeats: int) -> Dict[str, float]:
    """MemFit's own host time per batch on the tiny model, by layer (us, medians of `repeats` fits).

    Keys: the `OWN_LAYERS`, "own" (their sum: issue #38's item 4) and "next"
    (Keras's iterator, for scale). Each layer's figure also holds the cost of
    the timers nested in it (about 0.3 us each, three in all).
    """
    from keras_memfit import MemFit

    x, y = _data("tiny", steps)
    model = _model("tiny")
    b = BATCH["tiny"]
    model.fit(x[:b], y[:b], batch_size=b, verbose=0, callbacks=[MemFit()])  # compiles
    samples: Dict[str, List[float]] = {key: [] for key in (*OWN_LAYERS, "own", "next")}
    for r in range(repeats + 1):  # the first fit warms the timed path up; not counted
        totals = dict.fromkeys(("begin", "installed", "run", "next", "step"), 0.0)
        gc.collect()
        with _timed_layers(totals):
            model.fit(x, y, batch_size=b, epochs=1, shuffle=False, verbose=0,
                      callbacks=[MemFit()])
        if not all(totals.values()):  # a renamed layer would be timed as nothing
            raise RuntimeError(f"own_time: a timed layer never ran ({totals}); MemFit's "
                               "per-batch path changed: update `_timed_layers`")
        if r == 0:
            continue
        us = {key: seconds / steps * 1e6 for key, seconds in totals.items()}
        layers = {"begin": us["begin"],
                  "function": us["installed"] - us["next"] - us["run"],
                  "run": us["run"] - us["step"]}
        for key, value in layers.items():
            samples[key].append(value)
        samples["own"].append(sum(layers.values()))
        samples["next"].append(us["next"])
    return {key: float(np.median(values)) for key, values in samples.items()}


def own_verdict(own: Dict[str, float]) -> str:
    """Issue #38 item 4's target on MemFit's own host time, and whether `own` meets it."""
    return f"<= {OWN_US:.0f} us: " + ("pass" if own["own"] <= OWN_US else "FAIL")


def verdict(rows: List[Tuple[str, float, float, float, float]], steps: int) -> str:
    """Issue #20 item 5's target for `model.fit + MemFit`, and whether `rows` meet it."""
    medians = {label: median for label, median, *_ in rows}
    row = next(r for r in rows if r[0] == "model.fit + MemFit")
    _, _, ratio, extra, _ = row
    if medians["model.fit"] / steps >= LONG_STEP_S:
        return f"<= {FIT_RATIO}x: " + ("pass" if ratio <= FIT_RATIO else "FAIL")
    return f"<= +{HOST_US:.0f} us/step: " + ("pass" if extra <= HOST_US else "FAIL")


def section_markdown(results: Dict[str, list], own: Dict[str, float], own_steps: int,
                     info: Dict[str, str], argv: List[str], steps: Dict[str, int],
                     repeats: int) -> str:
    command = "python -m benchmarks.jax_floor" + ("" if not argv else " " + " ".join(argv))
    machine = common.machine_line(info)
    table = ["| Model | Batch | Steps | Loop | Median s | Ratio to its reference | Extra us/step "
             "| Extra host CPU us/step | Target (issue #20) |",
             "|---|---:|---:|---|---:|---:|---:|---:|---|"]
    for name, rows in results.items():
        for label, median, ratio, extra, extra_cpu in rows:
            target = verdict(rows, steps[name]) if label == "model.fit + MemFit" else ""
            table.append(f"| {name} | {BATCH[name]} | {steps[name]} | {label} | {median:.3f} | "
                         f"**{ratio:.3f}** | {extra:+.1f} | {extra_cpu:+.1f} | {target} |")
    table_text = "\n".join(table)
    own_table = "\n".join(
        ["| MemFit's layer, per batch | us |", "|---|---:|"]
        + [f"| {text} | {own[key]:.1f} |" for key, text in OWN_LAYERS.items()]
        + [f"| **MemFit's own host time** (target, issue #38: {own_verdict(own)}) "
           f"| **{own['own']:.1f}** |",
           f"| Keras's iterator, as MemFit's function pulls from it (for scale) "
           f"| {own['next']:.1f} |"])
    return f"""## Where MemFit's time per training step goes, JAX backend

Generated by `{command}`: {repeats} interleaved runs of each loop, the loops and models
as in `benchmarks/jax_floor.py`'s docstring. References: "Keras's step" (Keras's
compiled, donating train step, never waited for) and `model.fit` without the
callback. Target, on `model.fit + MemFit` by plain `model.fit`'s time per step:
within 1.02x where a step takes 2 ms or more, else at most 30 us added per step.
"Extra host CPU": the same difference in the main thread's CPU time.

{machine}

{table_text}

### MemFit's own host time per batch, by layer

The tiny model's `fit` (batch {BATCH["tiny"]}, {own_steps} batches) with MemFit, its step made a
no-op, timers around each layer (`own_time`; medians of {repeats} fits). A layer's
figure holds the cost of the timers nested in it (about 0.3 us each).

{own_table}
"""


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=None,
                        help="steps per loop, every model (default: cnn 20, mlp and tiny 1000)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs (default 9)")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--quick", action="store_true", help="a seconds-long smoke run")
    parser.add_argument("--write", action="store_true",
                        help="write the section (the default without --quick)")
    parser.add_argument("--output", default=os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "RESULTS.md"))
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    import keras

    if keras.backend.backend() != "jax":
        print(f"error: benchmarks.jax_floor needs KERAS_BACKEND=jax; received "
              f"KERAS_BACKEND={keras.backend.backend()}", file=sys.stderr)
        return 2
    steps = {name: args.steps or (QUICK_STEPS if args.quick else STEPS[name])
             for name in args.models}
    repeats = args.repeats or (2 if args.quick else 9)
    info = {"Date (UTC)": common.now_utc(), "CPU": common.cpu_model(),
            "CPU count (usable / total)": common.usable_cpus(),
            "Load average at start (1/5/15 min)": common.load_average(), **common.versions()}
    results = {}
    for name in args.models:
        results[name] = rows = measure(name, steps[name], repeats)
        for label, median, ratio, extra, extra_cpu in rows:
            print(f"{name:5s} {label:22s} {median:8.3f} s  ratio {ratio:.3f}  "
                  f"extra {extra:+7.1f} us/step  host CPU {extra_cpu:+7.1f} us/step")
        print(f"{name:5s} target: {verdict(rows, steps[name])}")
    own_steps = args.steps or (QUICK_STEPS if args.quick else OWN_STEPS)
    own = own_time(own_steps, repeats)
    for key, text in OWN_LAYERS.items():
        print(f"own   {own[key]:6.1f} us/batch  {text}")
    print(f"own   {own['own']:6.1f} us/batch  MemFit's own host time ({own_verdict(own)}); "
          f"Keras's iterator {own['next']:.1f}")
    if args.write or not args.quick:
        common.write_section(args.output, KEY, section_markdown(
            results, own, own_steps, info, argv, steps, repeats))
        print(f"\nwrote section '{KEY}' of {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
