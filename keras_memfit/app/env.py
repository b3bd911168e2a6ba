"""The environment a memory-limited worker process starts TensorFlow in.

A memory limit must be in place before TensorFlow is imported, so the
applications (the command line, the demo), the benchmarks and the tests start
their TensorFlow work in child processes whose environment carries it. This
module is the one place that recipe is written:

- **CPU** (`capped_cpu_env`): TensorFlow's BFC allocator capped at N MiB
  (`TF_CPU_ALLOCATOR_USE_BFC=true`, `TF_CPU_BFC_MEM_LIMIT_IN_MB=N`), oneDNN
  off (`TF_ENABLE_ONEDNN_OPTS=0`: its kernels crash instead of raising when
  the capped allocator refuses them) and GPUs hidden
  (`CUDA_VISIBLE_DEVICES=-1`: the work must run on the capped CPU).
- **GPU** (`configure_gpu`, in the child, before any op): the first GPU gets a
  logical device with `memory_limit=N` MiB and the other GPUs are hidden.

Under the CPU cap the inputs need one more step (`host_tensor`): TensorFlow
copies a numpy array it is given (`model.fit(x)`, `model.predict(x)`) into
its allocator, the capped one, and that host copy is not checked: when the
cap cannot hold it the process segfaults (or aborts) instead of raising
`ResourceExhaustedError`. On a GPU the inputs stay in host memory, outside
the card's limit; `host_tensor` gives the capped CPU the same: a tensor
sharing a host buffer, which the cap never counts.

It is also the one module outside `keras_memfit.backend` that imports
TensorFlow (`configure_gpu`, `gpu_visible` and `host_tensor`, only when
called): setting up a device before the backend starts is the environment's
job, not the seam's.

Example:
    >>> import os, subprocess, sys
    >>> env = dict(os.environ, **capped_cpu_env(400))
    >>> subprocess.run([sys.executable, "train.py"], env=env)
"""

from __future__ import annotations

import os
import sys
from typing import Any, Dict, Optional

import numpy as np

__all__ = [
    "CAP_VARIABLES",
    "capped_cpu_env",
    "configure_gpu",
    "gpu_visible",
    "host_tensor",
    "worker_environment",
]

# keras_memfit/app/env.py -> the folder holding the keras_memfit package.
_PACKAGE_PARENT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)
_DEVICES = ("cpu", "gpu")
_HOST_ALIGNMENT = 64  # bytes: TensorFlow aborts on an unaligned DLPack buffer
CAP_VARIABLES = ("TF_CPU_ALLOCATOR_USE_BFC", "TF_CPU_BFC_MEM_LIMIT_IN_MB")
"""The variables that cap TensorFlow's CPU allocator (removed for an uncapped GPU run)."""


def capped_cpu_env(mb: int) -> Dict[str, str]:
    """The environment variables that cap TensorFlow's CPU memory at `mb` MiB.

    Merge them into a child process's environment before it imports
    TensorFlow; they have no effect on a TensorFlow already running.

    Args:
        mb: The cap in MiB, a positive int.

    Returns:
        A new dict: `TF_CPU_ALLOCATOR_USE_BFC="true"`,
        `TF_CPU_BFC_MEM_LIMIT_IN_MB=str(mb)`, `TF_ENABLE_ONEDNN_OPTS="0"`
        (oneDNN's kernels crash instead of raising under the capped
        allocator) and `CUDA_VISIBLE_DEVICES="-1"` (the work must run on the
        capped CPU, not on a GPU).

    Raises:
        ValueError: If `mb` is not a positive int.

    Example:
        >>> capped_cpu_env(400)["TF_CPU_BFC_MEM_LIMIT_IN_MB"]
        '400'
    """
    if isinstance(mb, bool) or not isinstance(mb, int) or mb <= 0:
        raise ValueError(f"mb must be a positive int of MiB; received mb={mb!r}")
    return {
        "TF_CPU_ALLOCATOR_USE_BFC": "true",
        "TF_CPU_BFC_MEM_LIMIT_IN_MB": str(mb),
        "TF_ENABLE_ONEDNN_OPTS": "0",
        "CUDA_VISIBLE_DEVICES": "-1",
    }


def worker_environment(
    device: str, memory_limit_mb: Optional[int], base: Optional[Dict[str, str]] = None
) -> Dict[str, str]:
    """The environment a worker process runs with.

    Args:
        device: "cpu" or "gpu".
        memory_limit_mb: The limit in MiB (applied through the environment
            on CPU, `capped_cpu_env`; the child applies it itself on GPU,
            `configure_gpu`), or None for no limit: then the allocator
            settings of `base` are left as they are.
        base: Environment to start from; default `os.environ`. Not modified.

    Returns:
        A new environment mapping, finding this `keras_memfit` first on
        `PYTHONPATH`, with TensorFlow's INFO and WARNING logs off; with a limit
        on CPU, `capped_cpu_env(memory_limit_mb)`; with a limit on GPU,
        without CPU caps.

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
        env.update(capped_cpu_env(int(memory_limit_mb)))
    else:
        for key in CAP_VARIABLES:
            env.pop(key, None)
    return env


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


def configure_gpu(memory_limit_mb: int) -> None:
    """Limit the first GPU to `memory_limit_mb` MiB and hide the others.

    Must run in the worker before any TensorFlow op touches the GPU
    (`keras_memfit.app.worker.worker_main` calls it first).

    Args:
        memory_limit_mb: The logical device's memory limit in MiB.

    Raises:
        WorkerError: If TensorFlow sees no GPU, or its devices were
            initialised already.

    Example:
        >>> configure_gpu(1024)
    """
    import tensorflow as tf

    from keras_memfit.app.errors import WorkerError

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


def host_tensor(array: Any) -> Any:
    """A TensorFlow CPU tensor holding `array` in host memory, outside TensorFlow's allocator.

    For inputs under the capped CPU allocator (`capped_cpu_env`): given a
    numpy array, `model.fit`, `model.predict` and `tf.convert_to_tensor` copy
    it into that allocator, and the copy is not checked, so a cap that cannot
    hold it kills the process (a segfault in the copy, no
    `ResourceExhaustedError`). The tensor returned here shares a 64-byte
    aligned host buffer instead (through DLPack, without a copy into
    TensorFlow), so the cap counts only what a GPU would hold: the batches
    gathered from it, the weights, the activations. Slices along the first
    axis (`validation_split`, the pieces `safe_predict` takes) share it too.
    Uncapped or on a GPU it is an ordinary CPU tensor.

    Args:
        array: A numeric or bool array-like (numpy array, list); copied once
            into the new buffer, so later changes to `array` do not show.

    Returns:
        A `tf.Tensor` on the CPU with `array`'s shape, dtype and values.

    Raises:
        ValueError: If `array` is not numeric or bool (strings, objects).

    Example:
        >>> os.environ.update(capped_cpu_env(512))  # before TensorFlow starts
        >>> x_train = host_tensor(x_train)          # 131 MiB, not counted
        >>> model.fit(x_train, y_train, batch_size=1024, callbacks=[MemFit()])
    """
    values = np.asarray(array)
    if values.dtype.kind not in "biuf":
        raise ValueError(
            "host_tensor takes a numeric or bool array; received dtype "
            f"{values.dtype} (shape {values.shape}): pass strings and objects "
            "to Keras as they are"
        )
    buffer = np.empty(values.nbytes + _HOST_ALIGNMENT, np.uint8)
    start = -buffer.ctypes.data % _HOST_ALIGNMENT
    host = buffer[start:start + values.nbytes].view(values.dtype).reshape(values.shape)
    host[...] = values
    import tensorflow as tf

    # The capsule keeps `host` (and so `buffer`) alive until TensorFlow frees the tensor.
    return tf.experimental.dlpack.from_dlpack(host.__dlpack__())
