"""Memory statistics and limits of TensorFlow's devices, for the planner."""

from __future__ import annotations

import os
from typing import Optional, Tuple

import tensorflow as tf

def compute_device() -> str:
    """The device the model's computation runs on: the first GPU, else the CPU."""
    gpus = tf.config.list_logical_devices("GPU")
    return "GPU:0" if gpus else "CPU:0"


def memory_stats(device: str) -> Optional[Tuple[int, int]]:
    """(current, peak) bytes allocated by TensorFlow on `device`, or None."""
    try:
        info = tf.config.experimental.get_memory_info(device)
    except (ValueError, tf.errors.OpError):
        return None
    return int(info["current"]), int(info["peak"])


def memory_limit(device: str) -> Optional[Tuple[int, bool]]:
    """(bytes, exact) the allocator on `device` may use, or None when unknown.

    Known exactly for the capped CPU allocator (TF_CPU_ALLOCATOR_USE_BFC with
    TF_CPU_BFC_MEM_LIMIT_IN_MB) and for a GPU given a logical-device memory
    limit; from NVML (the optional `nvidia-ml-py`) for a whole GPU, as the
    device's memory less what other processes use, less 5% that TensorFlow
    keeps in reserve. `exact` says whether the planner may trust it before a
    first OOM; all three are trusted.
    """
    mib = 1 << 20
    if device.upper().startswith("CPU"):
        if os.environ.get("TF_CPU_ALLOCATOR_USE_BFC", "").lower() not in ("1", "true"):
            return None
        limit = os.environ.get("TF_CPU_BFC_MEM_LIMIT_IN_MB", "")
        return (int(limit) * mib, True) if limit.isdigit() else None
    index = int(device.rsplit(":", 1)[-1]) if ":" in device else 0
    physical = tf.config.list_physical_devices("GPU")
    if index < len(physical):
        try:
            configs = tf.config.get_logical_device_configuration(physical[index])
        except (ValueError, RuntimeError):
            configs = None
        if configs and getattr(configs[0], "memory_limit", None):
            return int(configs[0].memory_limit) * mib, True
    return _nvml_limit(index)


def _nvml_limit(index: int) -> Optional[Tuple[int, bool]]:
    try:
        import pynvml  # provided by the optional `nvidia-ml-py`
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        total = pynvml.nvmlDeviceGetMemoryInfo(handle).total
        others = 0
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid != os.getpid() and proc.usedGpuMemory:
                others += proc.usedGpuMemory
        # TensorFlow leaves a small reserve; 5% keeps the estimate conservative.
        return int((total - others) * 0.95), True
    except Exception:  # NVML missing, no permission, MIG, ...: treat as unknown
        return None


def reset_peak(device: str) -> None:
    """Start a new peak measurement on `device` (no-op where unsupported)."""
    try:
        tf.config.experimental.reset_memory_stats(device)
    except (ValueError, tf.errors.OpError):
        pass
