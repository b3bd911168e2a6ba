"""Two replicas against one: `safe_predict` under `tf.distribute.MirroredStrategy`.

Question: how long does `safe_predict` take with a model built under a
`MirroredStrategy` of two replicas, against the same model (same weights)
without a strategy, on one device? And against Keras's own `model.predict`
under the same strategy (keras_memfit's overhead with replicas)?

Method: one fresh child process (`benchmarks.jobs.run_job`: no memory cap,
oneDNN off, GPUs hidden) splits its CPU into two logical devices, "/CPU:0"
and "/CPU:1", the only way to have two replicas on a machine without two
GPUs. It builds the demo's CNN (`keras_memfit.app.demo.build_cnn`) once
under `MirroredStrategy(["/CPU:0", "/CPU:1"])` and once without a strategy,
with the same weights, checks that the three paths give the same outputs,
warms each up, then times them in interleaved rounds, rotating which goes
first: `safe_predict` on one device, `safe_predict` on two replicas,
`model.predict` on two replicas, all at the same batch size on the same
samples. Reported: each path's median, min and max seconds per call, and the
ratios of the medians.

What it means: the two logical CPUs are the same cores (here on a machine
shared with other jobs), not more hardware. Two replicas run their shares'
kernels at the same time, which can use the cores better than one device
running the whole piece (with oneDNN off a single convolution does not keep
every core busy); they also pay for splitting each piece, `strategy.run`'s
dispatch and concatenating the outputs. The ratio is the net of both on this
machine, not the speed-up of real devices; the RESULTS.md section states the
reasoned estimate for two GPUs next to the measurement.

Usage (from the repository root):
    python -m benchmarks.replicas            # full run (~1-2 min); rewrites its
                                             # section of benchmarks/RESULTS.md
    python -m benchmarks.replicas --quick    # seconds-long smoke run; writes
                                             # nothing unless --write is given
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

from benchmarks import common, jobs

HERE = os.path.dirname(os.path.abspath(__file__))
KEY = "replicas"
PATHS = ("one_device", "two_replicas", "keras_two_replicas")
LABELS = {
    "one_device": "`safe_predict`, one device (no strategy)",
    "two_replicas": "`safe_predict`, two replicas (MirroredStrategy)",
    "keras_two_replicas": "`model.predict`, two replicas (MirroredStrategy)",
}
FULL = dict(samples=8192, batch_size=1024, repeats=7)
QUICK = dict(samples=512, batch_size=256, repeats=2)

ESTIMATE = """\
**On two GPUs (a reasoned estimate, not a measurement).** The device time
per piece halves, the host's share (splitting, copying, `strategy.run`'s
dispatch, concatenating) does not: a compute-bound model such as this CNN
should take about 0.5-0.6x the one-GPU time, with pieces twice as large (the
planner budgets each GPU's memory for its half); small, fast models gain less."""


# --------------------------------------------------------------------------
# Child side
# --------------------------------------------------------------------------
def job(config: Dict[str, Any], say: jobs.Say = None) -> Dict[str, Any]:
    """Time the three paths in this (fresh) process; see the module docstring."""
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2
    )
    import keras
    import numpy as np

    import keras_memfit
    from keras_memfit.app.demo import build_cnn

    keras.utils.set_random_seed(0)
    single = build_cnn()
    strategy = tf.distribute.MirroredStrategy(["/CPU:0", "/CPU:1"])
    with strategy.scope():
        mirrored = build_cnn()
    mirrored.set_weights(single.get_weights())
    samples, batch = int(config["samples"]), int(config["batch_size"])
    x = np.random.default_rng(0).random((samples, 28, 28, 1), dtype=np.float32)

    calls = {
        "one_device": lambda: keras_memfit.safe_predict(single, x, batch_size=batch, verbose=0),
        "two_replicas": lambda: keras_memfit.safe_predict(
            mirrored, x, batch_size=batch, verbose=0
        ),
        "keras_two_replicas": lambda: mirrored.predict(x, batch_size=batch, verbose=0),
    }
    outputs = {name: call() for name, call in calls.items()}  # warm-up (tracing)
    for name, out in outputs.items():
        np.testing.assert_allclose(out, outputs["one_device"], rtol=1e-4, atol=1e-5,
                                   err_msg=name)
    times: Dict[str, List[float]] = {name: [] for name in PATHS}
    for r in range(int(config["repeats"])):
        order = PATHS[r % len(PATHS):] + PATHS[:r % len(PATHS)]
        for name in order:
            start = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - start)
        if say:
            say(f"round {r + 1}: " + ", ".join(f"{n} {times[n][-1]:.3f}s" for n in PATHS))
    return {"times": times, "replicas": strategy.num_replicas_in_sync,
            "devices": list(strategy.extended.worker_devices)}


# --------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------
def _span(times: Sequence[float]) -> str:
    return f"{statistics.median(times):.3f} ({min(times):.3f}-{max(times):.3f})"


def ratios(times: Dict[str, List[float]]) -> Dict[str, float]:
    """Ratios of medians: two replicas / one device, and keras_memfit / Keras on two replicas."""
    median = {name: statistics.median(values) for name, values in times.items()}
    return {
        "two_vs_one": median["two_replicas"] / median["one_device"],
        "memfit_vs_keras": median["two_replicas"] / median["keras_two_replicas"],
    }


def section(config: Dict[str, Any], result: Dict[str, Any], command: str) -> str:
    """The RESULTS.md section for one run."""
    times = result["times"]
    r = ratios(times)
    lines = [
        "## safe_predict on two replicas (tf.distribute.MirroredStrategy)",
        "",
        f"Generated by `{command}` on {common.now_utc()} UTC "
        f"(load average {common.load_average()}, CPUs usable {common.usable_cpus()}, "
        f"{common.cpu_model()}). Method: `benchmarks/replicas.py`'s docstring. "
        f"The demo's CNN, {config['samples']} samples, batch size {config['batch_size']}, "
        f"{config['repeats']} interleaved rounds; the replicas are two logical devices "
        "of one CPU (`/CPU:0`, `/CPU:1`), sharing its cores.",
        "",
        "| Path | Seconds per call: median (min-max) |",
        "|---|---:|",
    ]
    lines += [f"| {LABELS[name]} | {_span(times[name])} |" for name in PATHS]
    lines += [
        "",
        f"- **Two replicas / one device: {r['two_vs_one']:.3f}** (ratio of medians). "
        "The two logical devices are the same cores: the ratio nets the parallel "
        "kernels of the two shares against the cost of splitting each piece and "
        "concatenating its outputs; it is not the speed-up of two real devices.",
        f"- keras_memfit / Keras, both on two replicas: {r['memfit_vs_keras']:.3f} "
        "(Keras's own `predict` under the strategy was the slowest path here; "
        "why was not investigated).",
        "",
        ESTIMATE,
    ]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a seconds-long smoke run")
    parser.add_argument("--write", action="store_true",
                        help="rewrite the RESULTS.md section after --quick too")
    parser.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"))
    args = parser.parse_args(argv)
    config = dict(QUICK if args.quick else FULL)
    command = "python -m benchmarks.replicas" + (" --quick" if args.quick else "")
    result = jobs.run_job("benchmarks.replicas:job", config, cap_mb=None, report=print)
    text = section(config, result, command)
    print(text)
    if args.write or not args.quick:
        common.write_section(args.results, KEY, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
