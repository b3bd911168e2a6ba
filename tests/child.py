"""The one child-process harness of the tests: a Python child, in its own process group, bounded in time.

Every test that needs a fresh process uses it: the `memory_cap` and
`two_devices` markers (a child pytest under TensorFlow's capped allocator or
two logical CPUs, conftest.py) and `jax_support.run_in_jax` (a test function
in a child on JAX, with an address-space limit or several host devices).
The child runs in its own session, so a timeout kills it and everything it
started (a process stuck in native code may ignore SIGTERM: it gets SIGKILL).
"""

from __future__ import annotations

import importlib.util
import os
import resource
import signal
import subprocess
import sys
from typing import Dict, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_child(
    args: Sequence[str],
    env: Optional[Dict[str, str]] = None,
    timeout: float = 600,
    address_space: Optional[int] = None,
) -> subprocess.CompletedProcess:
    """Run `python args...` from the repository root with `env`; its output captured.

    Args:
        args: The interpreter's arguments (`["-m", "pytest", ...]`).
        env: The child's whole environment (default: this process's).
        timeout: Seconds before the child's process group is killed.
        address_space: An address-space limit in bytes (`RLIMIT_AS`), set in
            the child before its Python starts; None for none.

    Returns:
        The CompletedProcess (text stdout and stderr); on a timeout, one with
        return code -9 and a note appended to its stderr.
    """
    proc = subprocess.Popen(
        [sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
        preexec_fn=None if address_space is None else _limit(address_space),
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        stderr += f"\n[child killed after {timeout:.0f} s: {' '.join(args)}]"
        return subprocess.CompletedProcess(proc.args, -9, stdout, stderr)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _limit(address_space: int):
    def apply() -> None:  # in the child, before its Python starts
        resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))

    return apply


def run_function(target: str) -> None:
    """In a child: call `function` of the test module at `path`, given as "path:function"."""
    path, _, function = target.rpartition(":")
    spec = importlib.util.spec_from_file_location("child_test_module", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    getattr(module, function)()
