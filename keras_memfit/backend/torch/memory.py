"""Memory statistics and limits: CUDA's caching allocator, and the CPU under `RLIMIT_AS`."""

from __future__ import annotations

import ctypes
from typing import Any, Dict, Optional, Tuple

import torch

try:
    import resource
except ImportError:  # Windows: no address-space limit to read
    resource = None

_resets: Dict[str, Tuple[int, int]] = {}  # CPU device -> (VmSize, VmHWM) at reset_peak


def compute_device() -> str:
    """The device Keras's torch backend computes on: "cuda:0", "mps:0" or "cpu:0"."""
    from keras.src.backend.torch.core import get_device

    device = torch.device(get_device())
    return f"{device.type}:{device.index or 0}"


def _cuda_index(device: str) -> Optional[int]:
    """The CUDA ordinal of "cuda:N" or "/GPU:N" when CUDA is usable, else None."""
    text = device.strip().lstrip("/").lower()
    kind, _, index = text.partition(":")
    if kind not in ("cuda", "gpu") or not torch.cuda.is_available():
        return None
    ordinal = int(index) if index.isdigit() else 0
    return ordinal if ordinal < torch.cuda.device_count() else None


def _is_cpu(device: str) -> bool:
    return device.strip().lstrip("/").lower().partition(":")[0] == "cpu"


def _address_space() -> Optional[Dict[str, int]]:
    """The soft `RLIMIT_AS` and `VmSize`, `VmPeak`, `VmRSS`, `VmHWM` in bytes; None if unlimited."""
    if resource is None:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return None
    sizes = {"limit": int(soft)}
    try:
        with open("/proc/self/status") as status:
            for line in status:
                key, _, value = line.partition(":")
                if key in ("VmSize", "VmPeak", "VmRSS", "VmHWM"):
                    sizes[key] = int(value.split()[0]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return sizes if len(sizes) == 5 else None


def memory_stats(device: str) -> Optional[Tuple[int, int]]:
    index = _cuda_index(device)
    if index is not None:
        return int(torch.cuda.memory_allocated(index)), int(torch.cuda.max_memory_allocated(index))
    space = _address_space() if _is_cpu(device) else None
    if space is None:
        return None
    current = space["VmSize"]
    reset = _resets.get(device)
    if reset is None:
        return current, max(current, space["VmPeak"])
    size_then, resident_then = reset
    return current, max(current, size_then + space["VmHWM"] - resident_then)


def memory_limit(device: str) -> Optional[Tuple[int, bool]]:
    index = _cuda_index(device)
    if index is None:
        space = _address_space() if _is_cpu(device) else None
        return None if space is None else (space["limit"], True)
    free, total = torch.cuda.mem_get_info(index)
    limit = int(free) + int(torch.cuda.memory_reserved(index))
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if fraction is not None:
        try:
            limit = min(limit, int(fraction(index) * total))
        except (RuntimeError, TypeError):
            pass
    return limit, True


def reset_peak(device: str) -> None:
    """Reset CUDA's peak; on the CPU, the peak becomes `VmSize` now plus the rise of `VmHWM`."""
    index = _cuda_index(device)
    if index is not None:
        torch.cuda.reset_peak_memory_stats(index)
        return
    if not _is_cpu(device) or _address_space() is None:
        return
    _trim_heap()
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # VmHWM becomes VmRSS
    except OSError:
        pass  # the old mark stays: a lower bound
    space = _address_space()
    if space is not None:
        _resets[device] = (space["VmSize"], space["VmHWM"])


def _trim_heap() -> None:
    """glibc's `malloc_trim`, so that a piece reusing freed memory counts in `VmHWM`."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


def release_cached() -> None:
    """Return PyTorch's cached, unused CUDA blocks to the device."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def conv_columns(model: Any, device: str) -> bool:
    """False: not measured for torch's CPU convolutions."""
    return False


def compiles_per_shape(model: Any) -> bool:
    """False: steps run eagerly."""
    return False

