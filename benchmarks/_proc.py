"""Running one benchmark job in a fresh child process, optionally memory-capped.

The capped CPU allocator must be configured before TensorFlow is imported, so
every measured job runs in its own process: `python -m benchmarks._proc
TARGET CONFIG_PATH RESULT_PATH`, where TARGET is "module:function". The
child calls `function(config)` and writes the returned dict as JSON to
RESULT_PATH. The parent (`run_job`) imports no TensorFlow.

Environment of every child: oneDNN off (`TF_ENABLE_ONEDNN_OPTS=0`, its kernels
crash instead of raising under the capped allocator, and it is off in capped
and uncapped runs alike so that they compare), GPUs hidden, quiet TensorFlow
logging; with `cap_mb`, TensorFlow's BFC allocator capped at that many MiB
(`TF_CPU_ALLOCATOR_USE_BFC=true`, `TF_CPU_BFC_MEM_LIMIT_IN_MB`).

Child-side helpers live here too: counting the OOMs keras_memfit caught
(`OomCounter`) and the versions of what ran (`versions_job`).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class JobError(RuntimeError):
    """A benchmark child process failed; the message has the tail of its stderr."""


def child_environment(cap_mb: Optional[int]) -> Dict[str, str]:
    """The environment for a child, capped at `cap_mb` MiB when given."""
    env = dict(os.environ)
    for key in ("TF_CPU_ALLOCATOR_USE_BFC", "TF_CPU_BFC_MEM_LIMIT_IN_MB"):
        env.pop(key, None)
    env.update(
        TF_CPP_MIN_LOG_LEVEL="2",
        TF_ENABLE_ONEDNN_OPTS="0",
        KERAS_BACKEND="tensorflow",
        CUDA_VISIBLE_DEVICES="",
        PYTHONPATH=ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""),
    )
    if cap_mb is not None:
        env.update(TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPU_BFC_MEM_LIMIT_IN_MB=str(int(cap_mb)))
    return env


def run_job(
    target: str, config: Dict[str, Any], *, cap_mb: Optional[int], timeout: float = 1800,
) -> Dict[str, Any]:
    """Run `target(config)` in a fresh child process and return its result dict.

    Args:
        target: "module:function" (for example "benchmarks.seed:job").
        config: JSON-serialisable arguments for the function.
        cap_mb: MiB for TensorFlow's capped CPU allocator, or None for no cap.
        timeout: Seconds before the child is killed.

    Returns:
        The dict the function returned, plus "process_seconds" (wall time of
        the whole child, start-up included).

    Raises:
        JobError: If the child fails, crashes or times out.
    """
    with tempfile.TemporaryDirectory(prefix="memfit-bench-") as tmp:
        config_path = os.path.join(tmp, "config.json")
        result_path = os.path.join(tmp, "result.json")
        with open(config_path, "w") as f:
            json.dump(config, f)
        start = time.perf_counter()
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "benchmarks._proc", target, config_path, result_path],
                cwd=ROOT, env=child_environment(cap_mb), capture_output=True, text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired as err:
            raise JobError(f"{target} timed out after {timeout:.0f} s") from err
        seconds = time.perf_counter() - start
        if proc.returncode != 0 or not os.path.exists(result_path):
            tail = "\n".join((proc.stderr or "").strip().splitlines()[-25:])
            raise JobError(f"{target} failed (exit status {proc.returncode}):\n{tail}")
        with open(result_path) as f:
            result = json.load(f)
    result["process_seconds"] = seconds
    return result


# --------------------------------------------------------------------------
# Child side
# --------------------------------------------------------------------------
class OomCounter(logging.Handler):
    """Counts the OOMs keras_memfit caught (its "out of memory at" warnings).

    Example:
        >>> with OomCounter() as counter:
        ...     safe_predict(model, x, batch_size=28000)
        >>> counter.count
        0
    """

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "out of memory at batch_size=" in record.getMessage():
            self.count += 1

    def __enter__(self) -> "OomCounter":
        logger = logging.getLogger("keras_memfit")
        logger.addHandler(self)
        self._old_propagate = logger.propagate
        logger.propagate = False  # no warnings on the child's stderr
        return self

    def __exit__(self, *exc: Any) -> None:
        logger = logging.getLogger("keras_memfit")
        logger.removeHandler(self)
        logger.propagate = self._old_propagate


def versions_job(config: Dict[str, Any]) -> Dict[str, Any]:
    """Versions and devices as TensorFlow sees them (run in a child)."""
    import platform

    import keras
    import numpy as np
    import tensorflow as tf

    return {
        "Python": platform.python_version(),
        "TensorFlow": tf.__version__,
        "Keras": keras.__version__,
        "NumPy": np.__version__,
        "Devices seen by TensorFlow": ", ".join(
            d.name.replace("/physical_device:", "") for d in tf.config.list_physical_devices()
        ),
    }


def resolve(target: str) -> Callable[[Dict[str, Any]], Dict[str, Any]]:
    """The function named by "module:function"."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def main(argv: Optional[list] = None) -> int:
    target, config_path, result_path = (sys.argv[1:] if argv is None else argv)
    with open(config_path) as f:
        config = json.load(f)
    result = resolve(target)(config)
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
