"""Running work in a child process, optionally memory-limited, any failure as one line.

The child (`python -m keras_memfit.app.worker TARGET CONFIG_JSON RESULT_PATH`) calls
`TARGET` ("module:function") as `function(config, say)`; its returned dict is the result.
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

MODULE = "keras_memfit.app.worker"  # what the child runs with `python -m`

Reporter = Callable[[str], None]
Work = Callable[[Dict[str, Any], Reporter], Dict[str, Any]]


def stdout_reporter(line: str) -> None:
    """Print `line` (without its newline) to stdout and flush: the default reporter."""
    print(line, flush=True)


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
    """Run `target(config, say)` in a child process; the dict it returns, through JSON.

    Args:
        config: Without `env`, its "device" and "memory_limit_mb" choose the child's environment.
        report: Called with each line the child prints; default: stdout.
        what: How error messages name the child.
        segv_hint: Added to the message when the child dies of SIGSEGV.

    Raises:
        WorkerError: The work's error, or how the child crashed, failed or timed out, in one line.
    """
    report = report or stdout_reporter
    if env is None:
        env = _env.worker_environment(config["device"], config.get("memory_limit_mb"))
    with tempfile.TemporaryDirectory(prefix="keras_memfit_worker_") as tmp:
        result_path = os.path.join(tmp, "result.json")
        command = [sys.executable, "-m", MODULE, target, json.dumps(config), result_path]
        with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as stderr:
            proc = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=stderr, env=env, cwd=cwd,
                encoding="utf-8", errors="replace",
            )
            killed = threading.Event()

            def kill() -> None:
                killed.set()
                proc.kill()

            timer = threading.Timer(timeout, kill)
            if timeout is not None:
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
                timer.cancel()
            stderr.seek(0)
            errors = stderr.read()
        try:
            with open(result_path, encoding="utf-8") as f:
                result = json.load(f)
        except (OSError, ValueError):
            result = None
    if killed.is_set():
        raise WorkerError(f"{what} timed out after {timeout:g} s", errors)
    if result is not None and "error" in result:
        raise WorkerError(result["error"], errors)
    if code != 0 or result is None:
        raise WorkerError(_crash_message(code, errors, what, segv_hint), errors)
    return result


def _crash_message(code: int, errors: str, what: str, segv_hint: Optional[str] = None) -> str:
    """One line for a child that ended without a result (`code` < 0: killed by that signal)."""
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
    """The child: run the work (GPU limited first), write its result or `{"error": ...}`; 0 or 1."""
    code = 1
    try:
        config = json.loads(config_json)
        if config.get("device") == "gpu" and config.get("memory_limit_mb") is not None:
            _env.configure_gpu(int(config["memory_limit_mb"]))  # before any op touches the GPU
        result = resolve_target(target)(config, stdout_reporter)
        code = 0
    except WorkerError as err:
        result = {"error": " ".join(str(err).split())}
    except Exception as err:  # reported by the parent as one line
        traceback.print_exc()
        message = str(getattr(err, "message", None) or err).strip().splitlines()
        result = {"error": f"{type(err).__name__}: {message[0] if message else ''}"}
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
    # The imported module's `main`, so the work raises the `WorkerError` `worker_main` catches.
    from keras_memfit.app.worker import main as _main

    sys.exit(_main())
