"""MemFit across two JAX processes against Keras's own multi-process fit: the agreement's cost.

Question: what does MemFit's per-batch agreement between processes (each
process's gradients computed locally, then the coordination service's
key-value store, then one sum across the processes and one update; see
`keras_memfit/backend/jax/processes.py`) cost per training batch, against
Keras's own step with its all-reduce inside?

Method: two fresh child processes on 127.0.0.1
(`keras.distribution.initialize`, `DataParallel` with each process feeding
its own rows), no memory limit, nothing runs out of memory. Each builds the
same MLP (Dense(512, relu), Dense(10, softmax) on 32 features, SGD), warms
up both paths, then runs `fit` for one epoch of `--batches` batches of
`--batch` rows per process, in interleaved rounds, alternating which path
goes first: Keras's own `fit`, and `fit` with `MemFit()`. Reported (process
0): each path's median seconds per batch, their ratio, and the median time
per batch spent in `processes.agree` (posting this process's status and
reading the other's: it includes waiting for the other process to reach the
agreement, so it is an upper bound on the protocol's own cost).

What it means: on this machine the two processes share 2 CPU cores with
other jobs, so absolute times are noisy; the ratio is measured side by side.
On accelerators with fast interconnects the agreement's round trip to the
coordination service (a few RPCs per batch) is the part that does not shrink
with faster devices.

Usage (from the repository root):
    python -m benchmarks.processes            # full run (~2 min); rewrites its
                                              # section of benchmarks/RESULTS.md
    python -m benchmarks.processes --quick    # seconds-long smoke run; writes
                                              # nothing unless --write is given
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from typing import Any, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "RESULTS.md")
KEY = "processes"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _child(process: int, port: int, out: str, batch: int, batches: int, rounds: int) -> None:
    """One of the two processes: time both paths, process 0 writes the results."""
    import time

    import keras
    import numpy as np

    keras.distribution.initialize(job_addresses=f"127.0.0.1:{port}", num_processes=2,
                                  process_id=process)
    distribution = keras.distribution.DataParallel()
    distribution.auto_shard_dataset = False
    keras.distribution.set_distribution(distribution)

    import keras_memfit
    from keras_memfit.backend.jax import processes

    waits: List[float] = []
    agree = processes.agree

    def timed_agree(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return agree(*args, **kwargs)
        finally:
            waits.append(time.perf_counter() - start)

    processes.agree = timed_agree
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(512, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile("sgd", "sparse_categorical_crossentropy")
    rng = np.random.default_rng(process)
    x = rng.random((batch * batches, 32), dtype=np.float32)
    y = rng.integers(0, 10, batch * batches)

    def keras_fit() -> None:
        model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)

    def memfit_fit() -> None:
        model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0,
                  callbacks=[keras_memfit.MemFit()])

    paths = {"keras": keras_fit, "memfit": memfit_fit}
    for fn in paths.values():  # compile both
        fn()
    times: Dict[str, List[float]] = {name: [] for name in paths}
    agreement: List[float] = []
    for r in range(rounds):
        order = list(paths) if r % 2 == 0 else list(paths)[::-1]
        for name in order:
            before = len(waits)
            start = time.perf_counter()
            paths[name]()
            times[name].append((time.perf_counter() - start) / batches)
            if name == "memfit":
                agreement.append(sum(waits[before:]) / batches)
    if process == 0:
        with open(os.path.join(out, "processes.json"), "w") as f:
            json.dump({"times": times, "agreement": agreement, "batch": batch,
                       "batches": batches, "rounds": rounds}, f)


def measure(batch: int, batches: int, rounds: int, timeout: float = 600) -> Dict[str, Any]:
    """Run the two children; process 0's results."""
    port = _free_port()
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("XLA_FLAGS", None)
    with tempfile.TemporaryDirectory() as out:
        procs = [subprocess.Popen(
            ["timeout", "-k", "5", str(int(timeout)), sys.executable, "-m",
             "benchmarks.processes", "--child", str(p), str(port), out,
             "--batch", str(batch), "--batches", str(batches), "--rounds", str(rounds)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True) for p in range(2)]
        outputs = [proc.communicate()[0] for proc in procs]
        if any(proc.returncode for proc in procs):
            raise RuntimeError("a benchmark process failed:\n" + "\n".join(
                f"--- process {i} exit {proc.returncode}\n{text[-3000:]}"
                for i, (proc, text) in enumerate(zip(procs, outputs))))
        with open(os.path.join(out, "processes.json")) as f:
            return json.load(f)


def section(result: Dict[str, Any], command: str) -> str:
    """The RESULTS.md section of one run."""
    keras_s = statistics.median(result["times"]["keras"])
    memfit_s = statistics.median(result["times"]["memfit"])
    agree_ms = statistics.median(result["agreement"]) * 1000
    rows = [
        "## MemFit across two JAX processes (the agreement's cost per batch)",
        "",
        f"Two JAX processes on 127.0.0.1 sharing this machine's CPU cores, `DataParallel`, "
        f"each feeding {result['batch']} rows per batch; an MLP (Dense(512), Dense(10), "
        f"SGD); {result['rounds']} interleaved rounds of one epoch of {result['batches']} "
        "batches per path, nothing out of memory. Medians over the rounds, process 0.",
        "",
        "| path | seconds per batch | ratio to Keras |",
        "|---|---|---|",
        f"| Keras's own fit (all-reduce inside its step) | {keras_s:.4f} | 1.00 |",
        f"| fit with MemFit() (local gradients, agreement, one sum) | {memfit_s:.4f} | "
        f"{memfit_s / keras_s:.2f} |",
        "",
        f"Time per batch inside the agreement (`processes.agree`: one key posted, the other "
        f"process's key read, waiting for it included): median {agree_ms:.2f} ms "
        f"({agree_ms / 1000 / memfit_s:.0%} of MemFit's batch).",
        "",
        f"Command: `{command}`",
    ]
    return "\n".join(rows)


def main(argv: List[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a seconds-long smoke run")
    parser.add_argument("--write", action="store_true", help="write RESULTS.md after --quick")
    parser.add_argument("--child", nargs=3, metavar=("PROCESS", "PORT", "OUT"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--batches", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args(argv)
    batches = args.batches or (4 if args.quick else 20)
    rounds = args.rounds or (2 if args.quick else 7)
    if args.child:
        process, port, out = args.child
        _child(int(process), int(port), out, args.batch, batches, rounds)
        return
    result = measure(args.batch, batches, rounds)
    command = "python -m benchmarks.processes" + (" --quick" if args.quick else "")
    text = section(result, command)
    print(text)
    if not args.quick or args.write:
        from benchmarks.common import write_section

        write_section(RESULTS, KEY, text)


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main(sys.argv[1:])
