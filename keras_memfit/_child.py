"""Running command-line work in a child process, optionally memory-limited.

A memory limit must be in place before TensorFlow is imported, and
`import keras_memfit`'s public names import TensorFlow, so the command line
(`keras-memfit demo`, `predict`, `report`) runs its work in a child
process (`python -m keras_memfit._child TARGET CONFIG_JSON RESULT_PATH`)
started with the limit in its environment:

- **CPU**: TensorFlow's BFC allocator capped at N MiB
  (`TF_CPU_ALLOCATOR_USE_BFC=true`, `TF_CPU_BFC_MEM_LIMIT_IN_MB=N`), oneDNN
  off (`TF_ENABLE_ONEDNN_OPTS=0`: its kernels crash instead of raising when
  the capped allocator refuses them) and GPUs hidden.
- **GPU**: the first GPU gets a logical device with `memory_limit=N` MiB
  (`tf.config.set_logical_device_configuration`) in the child, before any op
  runs, and the other GPUs are hidden.

Without a limit the child runs with the caller's environment (plus quieter
TensorFlow logging). Either way the parent imports no TensorFlow, relays the
child's stdout line by line, keeps its stderr (TensorFlow's log noise) to
itself, and turns any failure, even a crash, into one line: a `WorkerError`.

The child calls `TARGET` ("module:function") as `function(config, say)`, where
`config` is the JSON-decoded dict (it must hold "device" and
"memory_limit_mb") and `say` prints a line to stdout; the returned dict is the
parent's result. A `WorkerError` raised there is reported as its message;
any other exception as its type and the first line of its message.

Example:
    >>> result = run_worker(
    ...     "keras_memfit.demo:_work", dict(device="cpu", memory_limit_mb=400, ...),
    ...     report=print, what="the demo's worker process")
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
from typing import Any, Callable, Dict, List, Optional, Sequence

__all__ = [
    "LogRecords",
    "Reporter",
    "WorkerError",
    "configure_gpu",
    "crash_message",
    "check_writable",
    "describe_sizes",
    "gpu_visible",
    "main",
    "run_worker",
    "stdout_reporter",
    "usual_size",
    "worker_environment",
    "worker_main",
]

_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_DEVICES = ("cpu", "gpu")

Reporter = Callable[[str], None]


class WorkerError(RuntimeError):
    """Work in the child process failed; the message is one line for the user."""


def stdout_reporter(line: str) -> None:
    """Print `line` to stdout and flush (the default reporter).

    Args:
        line: The line, without its newline.
    """
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


# --------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------
def gpu_visible() -> bool:
    """Whether TensorFlow would see a GPU, without importing it just to ask.

    Returns:
        False when `CUDA_VISIBLE_DEVICES` hides every GPU; TensorFlow's answer
        when it is imported already; else whether `/dev/nvidia0` exists.

    Example:
        >>> device = "gpu" if gpu_visible() else "cpu"
    """
    if os.environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1"):
        return False
    tf = sys.modules.get("tensorflow")
    if tf is not None:
        try:
            return bool(tf.config.list_physical_devices("GPU"))
        except Exception:  # a broken CUDA install: run on the CPU
            return False
    return os.path.exists("/dev/nvidia0")


def worker_environment(
    device: str, memory_limit_mb: Optional[int], base: Optional[Dict[str, str]] = None
) -> Dict[str, str]:
    """The environment a child process runs with.

    Args:
        device: "cpu" or "gpu".
        memory_limit_mb: The limit in MiB (applied through the environment
            on CPU; the child applies it itself on GPU), or None for no limit:
            then the allocator settings of `base` are left as they are.
        base: Environment to start from; default `os.environ`.

    Returns:
        A new environment mapping, finding this `keras_memfit` first on
        `PYTHONPATH`, with TensorFlow's INFO and WARNING logs off; with a limit
        on CPU, TensorFlow's capped BFC allocator, oneDNN off and GPUs hidden;
        with a limit on GPU, without CPU caps.

    Raises:
        ValueError: If `device` is not "cpu" or "gpu".

    Example:
        >>> env = worker_environment("cpu", 400)
        >>> env["TF_CPU_BFC_MEM_LIMIT_IN_MB"]
        '400'
    """
    if device not in _DEVICES:
        raise ValueError(f'device must be "cpu" or "gpu"; received device={device!r}')
    env = dict(os.environ if base is None else base)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = _PACKAGE_PARENT + (os.pathsep + path if path else "")
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONIOENCODING"] = "utf-8"
    env["KERAS_BACKEND"] = "tensorflow"
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    if memory_limit_mb is None:
        return env
    if device == "cpu":
        env["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
        env["TF_CPU_BFC_MEM_LIMIT_IN_MB"] = str(int(memory_limit_mb))
        env["TF_ENABLE_ONEDNN_OPTS"] = "0"  # oneDNN segfaults under the capped allocator
        env["CUDA_VISIBLE_DEVICES"] = "-1"  # the model must run on the capped CPU
    else:
        env.pop("TF_CPU_ALLOCATOR_USE_BFC", None)
        env.pop("TF_CPU_BFC_MEM_LIMIT_IN_MB", None)
    return env


def run_worker(
    target: str,
    config: Dict[str, Any],
    *,
    report: Optional[Reporter] = None,
    what: str = "the worker process",
    segv_hint: Optional[str] = None,
) -> Dict[str, Any]:
    """Run `target(config, say)` in a child process and return its result.

    Args:
        target: "module:function" to call in the child.
        config: JSON-serialisable dict for the function; its "device" ("cpu"
            or "gpu") and "memory_limit_mb" (MiB, or None) choose the
            child's environment (see `worker_environment`) and, on GPU with a
            limit, the logical device the child configures before any op.
        report: Called with each line the child prints to stdout; default:
            print it to stdout.
        what: How error messages name the child, e.g. "the demo's worker process".
        segv_hint: Appended to the error message when the child crashes with
            SIGSEGV (e.g. advice to raise a CPU memory limit).

    Returns:
        The dict the function returned (through JSON).

    Raises:
        WorkerError: With one line: the function's error, or how the child
            crashed or failed (the last line of its stderr).
        ValueError: If `config["device"]` is not "cpu" or "gpu".

    Example:
        >>> run_worker("keras_memfit.predict_file:predict_work", config,
        ...            what="the prediction process")
        {'samples': 28000, ...}
    """
    report = report or stdout_reporter
    limit = config.get("memory_limit_mb")
    env = worker_environment(config["device"], None if limit is None else int(limit))
    with tempfile.TemporaryDirectory(prefix="keras_memfit_worker_") as tmp:
        result_path = os.path.join(tmp, "result.json")
        stderr_path = os.path.join(tmp, "stderr.txt")
        command = [
            sys.executable, "-m", "keras_memfit._child", target, json.dumps(config), result_path,
        ]
        with open(stderr_path, "w+", encoding="utf-8", errors="replace") as stderr:
            proc = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=stderr, env=env,
                encoding="utf-8", errors="replace",
            )
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
            stderr.seek(0)
            errors = stderr.read()
        result = _read_json(result_path)
    if result is not None and "error" in result:
        raise WorkerError(result["error"])
    if code != 0 or result is None:
        raise WorkerError(crash_message(code, errors, what, segv_hint))
    return result


def crash_message(code: int, errors: str, what: str, segv_hint: Optional[str] = None) -> str:
    """One line saying how a child process ended without a result.

    Args:
        code: Its exit status (negative: killed by that signal).
        errors: What it wrote to stderr.
        what: How to name it, e.g. "the demo's worker process".
        segv_hint: Appended after "; " when it crashed with SIGSEGV.

    Returns:
        "WHAT crashed (SIGNAL)[; HINT]" or "WHAT failed (exit code N): LAST LINE".

    Example:
        >>> crash_message(-11, "", "the worker process")
        'the worker process crashed (SIGSEGV)'
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


# --------------------------------------------------------------------------
# Reporting helpers (either side)
# --------------------------------------------------------------------------
def usual_size(sizes: Sequence[int]) -> int:
    """The batch size run most often (the largest on a tie); 0 for no batches.

    Example:
        >>> usual_size([16, 64, 655, 655, 655, 410])
        655
    """
    return max(sorted(set(sizes), reverse=True), key=sizes.count) if sizes else 0


def check_writable(path: str, error: type = WorkerError) -> None:
    """Raises `error` with one line unless a file can be written at `path`.

    Args:
        path: An absolute path.
        error: The exception class to raise.

    Raises:
        WorkerError: (or `error`) if the folder does not exist or is not
            writable, or if `path` is a folder.
    """
    folder = os.path.dirname(path)
    if not os.path.isdir(folder):
        raise error(f"cannot write {path}: folder {folder} does not exist")
    if os.path.isdir(path):
        raise error(f"cannot write {path}: it is a folder")
    if not os.access(folder, os.W_OK):
        raise error(f"cannot write {path}: folder {folder} is not writable")


def describe_sizes(sizes: Sequence[int]) -> str:
    """Batch sizes run, consecutive equal sizes run-length encoded.

    Args:
        sizes: The size of every batch, in order.

    Returns:
        E.g. "16, 64, 755 x 36, 648"; "" for no batches.

    Example:
        >>> describe_sizes([16, 64, 655, 655, 655, 410])
        '16, 64, 655 x 3, 410'
    """
    parts: List[str] = []
    i = 0
    while i < len(sizes):
        j = i
        while j + 1 < len(sizes) and sizes[j + 1] == sizes[i]:
            j += 1
        count = j - i + 1
        parts.append(f"{sizes[i]} x {count}" if count > 1 else str(sizes[i]))
        i = j + 1
    return ", ".join(parts)


class LogRecords(logging.Handler):
    """Keeps the `keras_memfit` logger's messages, and shows them as they come.

    Attach it with `capture()` around the work; `messages` then holds every
    INFO-or-above message and `warnings` counts the WARNINGs (an OOM caught).

    Args:
        show: Called with "      [LEVEL] message" for each record, or None.

    Example:
        >>> records = LogRecords(None)
        >>> with records.capture():
        ...     safe_predict(model, x, batch_size=28000)
        >>> records.warnings  # OOMs paid
        1
    """

    def __init__(self, show: Optional[Reporter] = None) -> None:
        super().__init__(logging.INFO)
        self.messages: List[str] = []
        self.warnings = 0
        self.show = show

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        self.messages.append(message)
        if record.levelno >= logging.WARNING:
            self.warnings += 1
        if self.show is not None:
            self.show(f"      [{record.levelname}] {message}")

    def capture(self) -> "_Capture":
        """A context manager attaching this handler to the `keras_memfit` logger at INFO.

        Returns:
            The context manager.
        """
        return _Capture(self)


class _Capture:
    def __init__(self, handler: logging.Handler) -> None:
        self.handler = handler
        self.logger = logging.getLogger("keras_memfit")
        self.old_level = self.logger.level

    def __enter__(self) -> logging.Handler:
        self.old_level = self.logger.level
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self.handler)
        return self.handler

    def __exit__(self, *exc: Any) -> None:
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.old_level)


# --------------------------------------------------------------------------
# Child side
# --------------------------------------------------------------------------
def configure_gpu(memory_limit_mb: int) -> None:
    """Limit the first GPU to `memory_limit_mb` MiB and hide the others.

    Must run before any TensorFlow op touches the GPU.

    Args:
        memory_limit_mb: The logical device's memory limit in MiB.

    Raises:
        WorkerError: If TensorFlow sees no GPU, or its devices were
            initialised already.

    Example:
        >>> configure_gpu(1024)
    """
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        raise WorkerError("device 'gpu' was asked for but TensorFlow sees no GPU; use --device cpu")
    try:
        tf.config.set_visible_devices(gpus[0], "GPU")
        tf.config.set_logical_device_configuration(
            gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=memory_limit_mb)]
        )
    except RuntimeError as err:  # devices were initialised already
        raise WorkerError(f"could not limit the GPU's memory: {err}") from err


def worker_main(
    target: "str | Callable[[Dict[str, Any], Reporter], Dict[str, Any]]",
    config_json: str,
    result_path: str,
) -> int:
    """The child's entry point: run the work, write its result (or error) as JSON.

    Args:
        target: "module:function", or the function itself.
        config_json: The JSON config (with "device" and "memory_limit_mb").
        result_path: Where to write `{"error": ...}` or the function's result.

    Returns:
        0 on success, 1 if the work raised.

    Example:
        >>> worker_main("keras_memfit.demo:_work", json.dumps(config), "result.json")
        0
    """
    try:
        config = json.loads(config_json)
        if config.get("device") == "gpu" and config.get("memory_limit_mb") is not None:
            configure_gpu(int(config["memory_limit_mb"]))  # before any op touches the GPU
        work = _resolve(target) if isinstance(target, str) else target
        result = work(config, stdout_reporter)
        code = 0
    except WorkerError as err:
        result, code = {"error": " ".join(str(err).split())}, 1
    except Exception as err:  # reported by the parent as one line
        message = str(getattr(err, "message", None) or err).strip().splitlines()
        result = {"error": f"{type(err).__name__}: {message[0] if message else ''}"}
        code = 1
    with open(result_path, "w", encoding="utf-8") as f:
        json.dump(result, f)
    return code


def _resolve(target: str) -> Callable[[Dict[str, Any], Reporter], Dict[str, Any]]:
    module, _, name = target.partition(":")
    if not module or not name:
        raise ValueError(f"target must be 'module:function'; received {target!r}")
    return getattr(importlib.import_module(module), name)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m keras_memfit._child TARGET CONFIG_JSON RESULT_PATH`.

    Args:
        argv: The three arguments; default `sys.argv[1:]`.

    Returns:
        The exit status (2 for wrong arguments).

    Example:
        >>> main(["keras_memfit.demo:_work", json.dumps(config), "result.json"])
        0
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 3:
        sys.stderr.write(
            "usage: python -m keras_memfit._child MODULE:FUNCTION CONFIG_JSON RESULT_PATH\n"
        )
        return 2
    return worker_main(*argv)


if __name__ == "__main__":
    # Run the imported module's `main`, not this `__main__` copy, so that the
    # work raises the same `WorkerError` class that `worker_main` catches.
    from keras_memfit._child import main as _main

    sys.exit(_main())
