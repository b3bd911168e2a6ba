"""Memory statistics and limits of TensorFlow's devices, for the planner."""

from __future__ import annotations

import os
from typing import Any, Optional, Tuple

import tensorflow as tf



def compute_device() -> str:
    """The device the model's computation runs on: the first GPU, else the CPU."""
    gpus = tf.config.list_logical_devices("GPU")
    return "GPU:0" if gpus else "CPU:0"


def memory_stats(device: str) -> Optional[Tuple[int, int]]:
    try:
        info = tf.config.experimental.get_memory_info(device)
    except (ValueError, tf.errors.OpError):
        return None
    return int(info["current"]), int(info["peak"])


def memory_limit(device: str) -> Optional[Tuple[int, bool]]:
    """Exact for the capped CPU allocator and a GPU's logical-device limit; else NVML's, or None."""
    mib = 1 << 20
    if device.upper().startswith("CPU"):
        if os.environ.get("TF_CPU_ALLOCATOR_USE_BFC", "").lower() not in ("1", "true"):
            return None
        limit = os.environ.get("TF_CPU_BFC_MEM_LIMIT_IN_MB", "")
        return (int(limit) * mib, True) if limit.isdigit() else None
    index = int(device.rsplit(":", 1)[-1]) if ":" in device else 0
    # One per logical device in order (a GPU split into parts: only GPU:0's limit is read).
    physical = tf.config.get_visible_devices("GPU")
    if index >= len(physical):
        return None
    try:
        configs = tf.config.get_logical_device_configuration(physical[index])
    except (ValueError, RuntimeError):
        configs = None
    if configs and getattr(configs[0], "memory_limit", None):
        return int(configs[0].memory_limit) * mib, True
    return _nvml_limit(physical[index])


# TensorFlow's CUDA context, resident before its allocator measured free memory.
CUDA_CONTEXT_BYTES = 512 << 20
_nvml_ready: Optional[bool] = None  # None: not tried yet


def min_system_memory(available: int, cc_major: int) -> int:
    """Bytes TensorFlow leaves outside its GPU allocator (gpu_device.cc's `MinSystemMemory`)."""
    forced = os.environ.get("TF_DEVICE_MIN_SYS_MEMORY_IN_MB", "")
    if forced.isdigit():
        return int(forced) << 20
    if available < (2 << 30):
        return 225 << 20
    mib = {6: 500, 7: 1050, 8: 1536}.get(cc_major, 500 if cc_major < 6 else 1800)
    return mib << 20


def nvml_allocator_limit(total: int, others: int, cc_major: int) -> int:
    """The limit in bytes TensorFlow gives its allocator on a whole GPU, from NVML's numbers."""
    available = max(0, total - others - CUDA_CONTEXT_BYTES)
    return max(0, available - min_system_memory(available, cc_major))


def _nvml_index(physical: Any) -> Optional[Any]:
    """NVML's handle argument for TensorFlow's GPU `physical`: ("index", n), ("uuid", s) or None."""
    ordinal = int(physical.name.rsplit(":", 1)[-1])
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or not visible.strip():
        return "index", ordinal
    entries = [entry.strip() for entry in visible.split(",")]
    if ordinal >= len(entries):
        return None
    entry = entries[ordinal]
    if entry.isdigit():
        return "index", int(entry)
    if entry.startswith("GPU-"):
        return "uuid", entry
    return None  # a MIG slice (MIG-...): NVML's whole-device numbers do not apply


def _nvml_limit(physical: Any) -> Optional[Tuple[int, bool]]:
    global _nvml_ready
    if _nvml_ready is False:
        return None
    try:
        import pynvml  # from `nvidia-ml-py`
    except ImportError:
        _nvml_ready = False
        return None
    which = _nvml_index(physical)
    if which is None:
        return None
    try:
        if _nvml_ready is None:
            pynvml.nvmlInit()
            _nvml_ready = True
        if which[0] == "uuid":
            handle = pynvml.nvmlDeviceGetHandleByUUID(which[1])
        else:
            handle = pynvml.nvmlDeviceGetHandleByIndex(which[1])
        name = pynvml.nvmlDeviceGetName(handle)
        name = name.decode() if isinstance(name, bytes) else str(name)
        details = tf.config.experimental.get_device_details(physical)
        if details.get("device_name") and details["device_name"] != name:
            return None  # CUDA and NVML number this machine's GPUs differently
        total = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
        cc_major = int(pynvml.nvmlDeviceGetCudaComputeCapability(handle)[0])
        others = _other_processes_bytes(pynvml.nvmlDeviceGetComputeRunningProcesses(handle))
    except Exception:  # noqa: BLE001 - no driver, no permission, an old driver: unknown
        if _nvml_ready is None:
            _nvml_ready = False
        return None
    if others is None:
        return None
    return nvml_allocator_limit(total, others, cc_major), True


def _other_processes_bytes(processes: Any) -> Optional[int]:
    """Bytes the GPU's other processes use, or None when that cannot be told."""
    processes = list(processes)
    if not any(p.pid == os.getpid() for p in processes):
        # In a container NVML may report host pids: a lone process is this one.
        return 0 if len(processes) <= 1 else None
    used = [p.usedGpuMemory for p in processes if p.pid != os.getpid()]
    if any(u is None for u in used):
        return None
    return int(sum(used))


def reset_peak(device: str) -> None:
    try:
        tf.config.experimental.reset_memory_stats(device)
    except (ValueError, tf.errors.OpError):
        pass


def conv_columns(model: Any, device: str) -> bool:
    """On a CPU without XLA, whose kernels of a convolution's gradients build the column matrix."""
    return device.upper().startswith("CPU") and not compiles_per_shape(model)


def compiles_per_shape(model: Any) -> bool:
    """With `jit_compile=True` (Keras's default on a GPU); never when run eagerly."""
    if getattr(model, "run_eagerly", False):
        return False
    try:
        return bool(getattr(model, "jit_compile", False))
    except Exception:  # noqa: BLE001 - an uncompiled model resolving "auto"
        return False
