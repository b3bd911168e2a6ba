"""The environment a memory-limited worker process starts TensorFlow in.

A memory limit must be set before TensorFlow is imported, so the work runs in a child process.
The one module outside `keras_memfit.backend` that imports TensorFlow (only when called).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Dict, Optional

import numpy as np

# keras_memfit/app/env.py -> the folder holding the keras_memfit package.
_PACKAGE_PARENT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)
_HOST_ALIGNMENT = 64  # bytes: TensorFlow aborts on an unaligned DLPack buffer
CAP_VARIABLES = ("TF_CPU_ALLOCATOR_USE_BFC", "TF_CPU_BFC_MEM_LIMIT_IN_MB")
"""The variables that cap TensorFlow's CPU allocator (removed for an uncapped GPU run)."""


def capped_cpu_env(mb: int) -> Dict[str, str]:
    """The environment variables that cap TensorFlow's CPU memory at `mb` MiB, before it starts.

    They also turn oneDNN off (its kernels crash under the cap) and hide the GPUs.

    Raises:
        ValueError: If `mb` is not a positive int.
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
    """A worker's environment: this `keras_memfit` first on `PYTHONPATH`, TensorFlow's logs off.

    Args:
        memory_limit_mb: MiB (on GPU the child's `configure_gpu` applies it), or None to keep
            `base`'s allocator settings.
        base: Environment to start from (not modified); default `os.environ`.
    """
    if device not in ("cpu", "gpu"):
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
    """Whether TensorFlow would see a GPU, without importing it just to ask."""
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
    """Limit the first GPU to `memory_limit_mb` MiB and hide the others, before any op runs.

    Raises:
        WorkerError: If TensorFlow sees no GPU, or its devices were initialised already.
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
    """A CPU `tf.Tensor` copy of `array` in aligned host memory (DLPack), outside the CPU cap.

    A numpy array TensorFlow copies into the cap is unchecked (docs/development.md).

    Raises:
        ValueError: If `array` is not numeric or bool.
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
