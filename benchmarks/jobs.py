"""Running one benchmark job in a fresh child process, optionally memory-capped.

The capped CPU allocator must be configured before TensorFlow is imported, so
every measured job runs in its own process, through the applications' worker
runner (`keras_memfit.app.worker.run_worker`: `python -m
keras_memfit.app.worker TARGET CONFIG_JSON RESULT_PATH`), which calls
`function(config, say)` and hands back the returned dict. The parent
(`run_job`) imports no TensorFlow.

Environment of every child (`child_environment`): the capped allocator's
recipe (`keras_memfit.app.env.capped_cpu_env`), quiet TensorFlow logging;
uncapped runs keep the recipe's oneDNN off and GPUs hidden without the cap,
so that capped and uncapped runs compare.

Child-side helpers live here too: counting the OOMs keras_memfit caught
(`OomCounter`) and the versions of what ran (`versions_job`).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Dict, Optional

from benchmarks import common
from keras_memfit.app import env as app_env
from keras_memfit.app import worker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

Say = Optional[Callable[[str], None]]


class JobError(RuntimeError):
    """A benchmark child process failed; the message has the tail of its stderr."""


def child_environment(cap_mb: Optional[int], backend: str = "tensorflow") -> Dict[str, str]:
    """The environment for a child, capped at `cap_mb` MiB when given.

    Args:
        cap_mb: MiB for TensorFlow's capped CPU allocator, or None for none.
        backend: Keras's backend in the child: "tensorflow", or "jax" (no cap:
            the capped allocator is TensorFlow's).

    Returns:
        This process's environment with this checkout first on `PYTHONPATH`,
        quiet TensorFlow logging, Keras on TensorFlow, and
        `capped_cpu_env(cap_mb)`; uncapped, the same without its cap (nor any
        cap the caller had set).
    """
    env = app_env.worker_environment("cpu", None)
    env.update(app_env.capped_cpu_env(1 if cap_mb is None else int(cap_mb)))
    if cap_mb is None:  # the same kernels as a capped run, without the cap
        for key in app_env.CAP_VARIABLES:
            del env[key]
    if backend != "tensorflow":
        if cap_mb is not None:
            raise ValueError(f"the capped allocator is TensorFlow's; received cap_mb={cap_mb} "
                             f"with backend={backend!r}")
        env["KERAS_BACKEND"] = backend
    if env["PYTHONPATH"].split(os.pathsep)[0] != ROOT:  # `benchmarks` must import
        env["PYTHONPATH"] = ROOT + os.pathsep + env["PYTHONPATH"]
    return env


def run_job(
    target: str, config: Dict[str, Any], *, cap_mb: Optional[int], timeout: float = 1800,
    report: Say = None, backend: str = "tensorflow",
) -> Dict[str, Any]:
    """Run `target(config, say)` in a fresh child process and return its result dict.

    Args:
        target: "module:function" (for example "benchmarks.seed:job").
        config: JSON-serialisable arguments for the function.
        cap_mb: MiB for TensorFlow's capped CPU allocator, or None for no cap.
        timeout: Seconds before the child is killed.
        report: Called with each line the child prints; default: dropped.
        backend: Keras's backend in the child ("tensorflow" or "jax").

    Returns:
        The dict the function returned, plus "process_seconds" (wall time of
        the whole child, start-up included).

    Raises:
        JobError: If the child fails, crashes or times out.
    """
    start = time.perf_counter()
    try:
        result = worker.run_worker(
            target, config, report=report or (lambda line: None), what=target,
            env=child_environment(cap_mb, backend), cwd=ROOT, timeout=timeout,
        )
    except worker.WorkerError as err:
        tail = "\n".join(err.stderr.strip().splitlines()[-25:])
        raise JobError(f"{target} failed: {err}" + (f"\n{tail}" if tail else "")) from err
    result["process_seconds"] = time.perf_counter() - start
    return result


def run_here(target: str, config: Dict[str, Any]) -> Dict[str, Any]:
    """Run `target(config)` in this process (--quick: no fresh process per job)."""
    return worker.resolve_target(target)(config, None)


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


def versions_job(config: Dict[str, Any], say: Say = None) -> Dict[str, Any]:
    """Versions and devices as the child's Keras backend sees them (run in a child)."""
    return common.versions()
