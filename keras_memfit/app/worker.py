"""Running work in a child process, optionally memory-limited: the worker runner.

The child (`python -m keras_memfit.app.worker TARGET CONFIG_JSON RESULT_PATH`)
calls `TARGET` ("module:function") as `function(config, say)`: `config` is the
JSON-decoded dict, `say` prints a line to stdout, and the returned dict is the
parent's result. The parent imports no TensorFlow, relays the child's stdout
line by line, keeps its stderr (TensorFlow's logs, tracebacks) to itself, and
turns any failure, even a crash, into one line: a `WorkerError` (the message of
one the work raised; any other exception's type and first line).
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from typing import Any, Callable, Dict, Optional, Sequence

from keras_memfit.app import env as _env
from keras_memfit.app.errors import WorkerError

__all__ = [
    "Reporter",
    "WorkerError",
    "check_writable",
    "main",
    "resolve_target",
    "run_worker",
    "stdout_reporter",
    "worker_main",
]

MODULE = "keras_memfit.app.worker"  # what the child runs with `python -m`

Reporter = Callable[[str], None]
Work = Callable[[Dict[str, Any], Reporter], Dict[str, Any]]


def stdout_reporter(line: str) -> None:
    """Print `line` (without its newline) to stdout and flush: the default reporter."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


# --------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------
def run_worker(
    target: str,
    config: Dict[str, Any],
    *,
    report: Optional[Reporter] = None,
    what: str = "the worker process",
    segv_hint: Optional[str] = None,
    env: Optional[Dict[str, str]] = None,
    cwd: Optional[str] = None,
    timeout: Optional[float] = None,
) -> Dict[str, Any]:
    """Run `target(config, say)` in a child process and return its result.

    Args:
        target: "module:function" to call in the child.
        config: JSON-serialisable dict for the function. Unless `env` is
            given, its "device" ("cpu" or "gpu") and "memory_limit_mb" (MiB,
            or None) choose the child's environment
            (`keras_memfit.app.env.worker_environment`).
        report: Called with each line the child prints to stdout; default:
            print it to stdout.
        what: How error messages name the child, e.g. "the demo's worker process".
        segv_hint: Appended to the error message when the child crashes with
            SIGSEGV (e.g. advice to raise a CPU memory limit).
        env: The child's whole environment, instead of the one `config` chooses.
        timeout: Seconds before the child is killed; default: no limit.

    Returns:
        The dict the function returned (through JSON).

    Raises:
        WorkerError: With one line: the function's error, or how the child
            crashed, failed or timed out; its `stderr` holds all the child
            wrote there.
        ValueError: If `config["device"]` is not "cpu" or "gpu" (without `env`).
    """
    report = report or stdout_reporter
    if env is None:
        limit = config.get("memory_limit_mb")
        env = _env.worker_environment(config["device"], None if limit is None else int(limit))
    with tempfile.TemporaryDirectory(prefix="keras_memfit_worker_") as tmp:
        result_path = os.path.join(tmp, "result.json")
        stderr_path = os.path.join(tmp, "stderr.txt")
        command = [sys.executable, "-m", MODULE, target, json.dumps(config), result_path]
        with open(stderr_path, "w+", encoding="utf-8", errors="replace") as stderr:
            proc = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=stderr, env=env, cwd=cwd,
                encoding="utf-8", errors="replace",
            )
            killed = threading.Event()

            def kill() -> None:
                killed.set()
                proc.kill()

            timer = None if timeout is None else threading.Timer(timeout, kill)
            if timer is not None:
                timer.start()
            try:
                for line in proc.stdout:
                    report(line.rstrip("\n"))
                code = proc.wait()
            except BaseException:  # Ctrl-C or a failing reporter: stop the child
                proc.kill()
                proc.wait()
                raise
            finally:
                proc.stdout.close()
                if timer is not None:
                    timer.cancel()
            stderr.seek(0)
            errors = stderr.read()
        result = _read_json(result_path)
    if killed.is_set():
        raise WorkerError(f"{what} timed out after {timeout:g} s", errors)
    if result is not None and "error" in result:
        raise WorkerError(result["error"], errors)
    if code != 0 or result is None:
        raise WorkerError(_crash_message(code, errors, what, segv_hint), errors)
    return result


def _crash_message(code: int, errors: str, what: str, segv_hint: Optional[str] = None) -> str:
    """One line for a child that ended without a result (`code` < 0: killed by that signal).

    "WHAT crashed (SIGNAL)[; SEGV_HINT]" or "WHAT failed (exit code N): LAST STDERR LINE".
    """
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        message = f"{what} crashed ({name})"
        if segv_hint and name == "SIGSEGV":
            message += f"; {segv_hint}"
        return message
    lines = [line.strip() for line in errors.splitlines() if line.strip()]
    last = lines[-1] if lines else "no error message"
    return f"{what} failed (exit code {code}): {last}"


def _read_json(path: str) -> Optional[Dict[str, Any]]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def check_writable(path: str, error: type = WorkerError) -> None:
    """Raise `error` with one line unless a file can be written at `path` (absolute)."""
    folder = os.path.dirname(path)
    if not os.path.isdir(folder):
        raise error(f"cannot write {path}: folder {folder} does not exist")
    if os.path.isdir(path):
        raise error(f"cannot write {path}: it is a folder")
    if not os.access(folder, os.W_OK):
        raise error(f"cannot write {path}: folder {folder} is not writable")


# --------------------------------------------------------------------------
# Child side
# --------------------------------------------------------------------------
def worker_main(target: str, config_json: str, result_path: str) -> int:
    """The child's entry point: run the work, write its result or `{"error": ...}` as JSON.

    With "device" "gpu" and a "memory_limit_mb" in the config, the GPU is
    limited first. Returns 0, or 1 if the work raised (its traceback on stderr).
    """
    try:
        config = json.loads(config_json)
        if config.get("device") == "gpu" and config.get("memory_limit_mb") is not None:
            _env.configure_gpu(int(config["memory_limit_mb"]))  # before any op touches the GPU
        result = resolve_target(target)(config, stdout_reporter)
        code = 0
    except WorkerError as err:
        result, code = {"error": " ".join(str(err).split())}, 1
    except Exception as err:  # reported by the parent as one line
        traceback.print_exc()
        message = str(getattr(err, "message", None) or err).strip().splitlines()
        result = {"error": f"{type(err).__name__}: {message[0] if message else ''}"}
        code = 1
    with open(result_path, "w", encoding="utf-8") as f:
        json.dump(result, f)
    return code


def resolve_target(target: str) -> Work:
    """The function a "module:function" target names (importing the module)."""
    module, _, name = target.partition(":")
    if not module or not name:
        raise ValueError(f"target must be 'module:function'; received {target!r}")
    return getattr(importlib.import_module(module), name)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m keras_memfit.app.worker TARGET CONFIG_JSON RESULT_PATH`; 2 for wrong arguments."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 3:
        sys.stderr.write(f"usage: python -m {MODULE} MODULE:FUNCTION CONFIG_JSON RESULT_PATH\n")
        return 2
    return worker_main(*argv)


if __name__ == "__main__":
    # Run the imported module's `main`, not this `__main__` copy, so that the
    # work raises the same `WorkerError` class that `worker_main` catches.
    from keras_memfit.app.worker import main as _main

    sys.exit(_main())
