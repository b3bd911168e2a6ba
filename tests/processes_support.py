"""Harness for tests with two JAX processes on 127.0.0.1 (multi-controller JAX).

`run_processes(__file__, "function", ...)` starts two children, each with
`KERAS_BACKEND=jax` under `timeout -k 5 T` in its own process group, each
joining the same coordination service on a free loopback port
(`keras.distribution.initialize(job_addresses="127.0.0.1:PORT",
num_processes=2, process_id=i)`), then calling `function(process_id, out)`
of the test module: `out` is a folder both write their results to (NumPy
files the test compares). A test function limits one process's address space
(`limit_address_space(margin_mb)`: what it uses now plus a margin, so that
only that process's large allocations fail with a real `RESOURCE_EXHAUSTED`;
set once the runtime is up rather than before Python starts, because the
runtime's own reservations, threads and gloo, vary from machine to machine
and the margin does not).

`run_reference(__file__, "function", out)` runs `function(out)` in one plain
JAX process (no distribution): the single-process reference.
"""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import time
from typing import Dict, List, Optional

from tests.child import ROOT, run_child

_ENV = {"KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu", "MALLOC_ARENA_MAX": "1",
        "TF_CPP_MIN_LOG_LEVEL": "3"}


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _env(extra: Optional[Dict[str, str]]) -> Dict[str, str]:
    env = dict(os.environ, **_ENV)
    env.pop("XLA_FLAGS", None)
    env.update(extra or {})
    return env


def run_processes(
    path: str,
    function: str,
    out: str,
    *,
    timeout: float = 240,
    env: Optional[Dict[str, str]] = None,
) -> List[subprocess.CompletedProcess]:
    """Run `function(process_id, out)` of module `path` in two JAX processes together.

    Returns:
        Both CompletedProcesses (text output), in process order; a process
        still running after `timeout` is killed by `timeout` (exit 124, or
        137 after SIGKILL), with its whole process group.
    """
    port = free_port()
    target = f"{os.path.abspath(path)}:{function}"
    procs = []
    for process in range(2):
        args = ["timeout", "-k", "5", str(int(timeout)), sys.executable, "-m",
                "tests.processes_support", target, str(process), str(port), out]
        procs.append(subprocess.Popen(
            args, cwd=ROOT, env=_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True))
    results = []
    for proc in procs:
        try:
            stdout, _ = proc.communicate(timeout=timeout + 30)
        except subprocess.TimeoutExpired:  # timeout itself stuck: never expected
            os.killpg(proc.pid, 9)
            stdout, _ = proc.communicate()
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, ""))
    return results


def run_reference(path: str, function: str, out: str, timeout: float = 240) -> str:
    """Run `function(out)` of module `path` in one plain JAX process; its output.

    Raises:
        AssertionError: If the child failed (with its output).
    """
    target = f"{os.path.abspath(path)}:{function}"
    proc = run_child(["-m", "tests.processes_support", target, "-1", "0", out],
                     _env(None), timeout)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{target} failed (exit {proc.returncode}):\n{output[-6000:]}"
    return output


def describe(results: List[subprocess.CompletedProcess]) -> str:
    """Both processes' exit codes and the end of their output, for assertion messages."""
    return "\n".join(f"--- process {i} exit {r.returncode}:\n{r.stdout[-4000:]}"
                     for i, r in enumerate(results))


def limit_address_space(margin_mb: int) -> int:
    """Limit this process's address space to what it uses now plus `margin_mb`; the limit."""
    with open("/proc/self/status") as status:
        size_kb = next(int(line.split()[1]) for line in status if line.startswith("VmSize:"))
    limit = size_kb * 1024 + margin_mb * (1 << 20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    print(f"address space limited to {limit / 2**30:.2f} GiB ({margin_mb} MiB over its use)",
          flush=True)
    return limit


def _main(target: str, process: int, port: int, out: str) -> None:
    import importlib.util

    path, _, function = target.rpartition(":")
    spec = importlib.util.spec_from_file_location("processes_test_module", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if process < 0:
        getattr(module, function)(out)
        return
    import keras

    keras.distribution.initialize(job_addresses=f"127.0.0.1:{port}", num_processes=2,
                                  process_id=process)
    start = time.monotonic()
    getattr(module, function)(process, out)
    print(f"process {process}: done in {time.monotonic() - start:.1f} s", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    _main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
