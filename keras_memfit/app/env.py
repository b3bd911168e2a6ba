"""The environment a memory-limited worker process starts TensorFlow in.

A memory limit must be in place before TensorFlow is imported, so the
applications, the benchmarks and the tests start their TensorFlow work in child
processes whose environment carries it. This is the one place that recipe is
written: `capped_cpu_env` on the CPU, `configure_gpu` (in the child) on a GPU;
`host_tensor` keeps inputs outside the CPU cap. It is the one module outside
`keras_memfit.backend` that imports TensorFlow (only when called): setting up a
device before the backend starts is the environment's job, not the seam's.
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

    Returns:
        A new dict: `TF_CPU_ALLOCATOR_USE_BFC="true"`,
        `TF_CPU_BFC_MEM_LIMIT_IN_MB=str(mb)`, `TF_ENABLE_ONEDNN_OPTS="0"`
        (oneDNN's kernels crash instead of raising under the cap) and
        `CUDA_VISIBLE_DEVICES="-1"` (the work must run on the capped CPU).

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
    """The environment a worker process runs with.

    Args:
        memory_limit_mb: The limit in MiB (on CPU through `capped_cpu_env`;
            on GPU the child applies it, `configure_gpu`), or None for no
            limit: then the allocator settings of `base` are left as they are.
        base: Environment to start from; default `os.environ`. Not modified.

    Returns:
        A new environment mapping, finding this `keras_memfit` first on
        `PYTHONPATH`, with TensorFlow's INFO and WARNING logs off; with a limit
        on GPU, without CPU caps.

    Raises:
        ValueError: If `device` is not "cpu" or "gpu".
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

    False when `CUDA_VISIBLE_DEVICES` hides every GPU; TensorFlow's answer when
    it is imported already; else whether `/dev/nvidia0` exists.
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

    Raises:
        WorkerError: If TensorFlow sees no GPU, or its devices were
            initialised already.
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

    For inputs under the capped CPU allocator (`capped_cpu_env`): `model.fit`,
    `model.predict` and `tf.convert_to_tensor` copy a numpy array into that
    allocator unchecked, so a cap that cannot hold it kills the process (a
    segfault, no `ResourceExhaustedError`). This tensor shares an aligned host
    buffer instead (DLPack), so the cap counts only what a GPU would hold: the
    batches gathered from it, the weights, the activations. Slices along the
    first axis share it too. Uncapped or on a GPU it is an ordinary CPU tensor.

    Args:
        array: A numeric or bool array-like; copied once into the new buffer,
            so later changes to `array` do not show.

    Returns:
        A `tf.Tensor` on the CPU with `array`'s shape, dtype and values.

    Raises:
        ValueError: If `array` is not numeric or bool (strings, objects).
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
