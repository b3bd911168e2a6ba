"""Memory statistics and limits of JAX's devices, for the planner.

From `device.memory_stats()` (GPU, TPU); on the CPU, under `RLIMIT_AS`, that limit and the
process's virtual size. JAX cannot reset a peak: `reset_peak` records it, and until the peak
rises above it `memory_stats` reports a lower bound (the larger bytes in use).
"""

from __future__ import annotations

import resource
from typing import Any, Dict, Optional, Tuple

import jax

_resets: Dict[str, Tuple[int, int]] = {}  # device -> (peak, in use) at reset_peak


def compute_device() -> str:
    device = jax.devices()[0]
    return f"{device.platform}:{device.id}"


def _device(name: str) -> Optional[Any]:
    for device in jax.devices():
        if f"{device.platform}:{device.id}" == name.lower().lstrip("/"):
            return device
    return None


def _raw_stats(name: str) -> Optional[Dict[str, int]]:
    device = _device(name)
    if device is None:
        return None
    try:
        stats = device.memory_stats()
    except Exception:  # not implemented on this platform
        return None
    if not stats or "bytes_in_use" not in stats:
        return _address_space() if device.platform == "cpu" else None
    return stats


def _address_space() -> Optional[Dict[str, int]]:
    """The CPU's memory as `memory_stats()` would give it, from `RLIMIT_AS`; None without one."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return None
    sizes = {}
    try:
        with open("/proc/self/status") as status:
            for line in status:
                key, _, value = line.partition(":")
                if key in ("VmSize", "VmPeak"):
                    sizes[key] = int(value.split()[0]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    if "VmSize" not in sizes:
        return None
    return {"bytes_in_use": sizes["VmSize"], "bytes_limit": int(soft),
            "peak_bytes_in_use": max(sizes.get("VmPeak", 0), sizes["VmSize"])}


def memory_stats(device: str) -> Optional[Tuple[int, int]]:
    stats = _raw_stats(device)
    if stats is None:
        return None
    current = int(stats["bytes_in_use"])
    peak = int(stats.get("peak_bytes_in_use", current))
    reset = _resets.get(device)
    if reset is not None and peak <= reset[0]:
        peak = max(reset[1], current)
    return current, peak


def memory_limit(device: str) -> Optional[Tuple[int, bool]]:
    stats = _raw_stats(device)
    if stats is None or not stats.get("bytes_limit"):
        return None
    return int(stats["bytes_limit"]), True


def free_bytes(device: str) -> Optional[int]:
    """Bytes `device` can still allocate, or None if unknown."""
    stats = _raw_stats(device)
    if stats is None or not stats.get("bytes_limit"):
        return None
    return int(stats["bytes_limit"]) - int(stats["bytes_in_use"])


def reset_peak(device: str) -> None:
    stats = _raw_stats(device)
    if stats is not None:
        current = int(stats["bytes_in_use"])
        _resets[device] = (int(stats.get("peak_bytes_in_use", current)), current)


def conv_columns(model: Any, device: str) -> bool:
    """False: XLA's CPU convolutions were not measured building one."""
    return False


def compiles_per_shape(model: Any) -> bool:
    return not (getattr(model, "run_eagerly", False) or not getattr(model, "jit_compile", True))
