"""Memory statistics and limits of PyTorch's devices, for the planner.

On CUDA, from PyTorch's caching allocator: `torch.cuda.memory_allocated`
(bytes held by tensors), `torch.cuda.max_memory_allocated` since
`torch.cuda.reset_peak_memory_stats`, and as the limit what the allocator
can still reach: the device's free memory (`torch.cuda.mem_get_info`) plus
what it already reserved (`torch.cuda.memory_reserved`), bounded by a
per-process memory fraction where one is set
(`torch.cuda.set_per_process_memory_fraction`).

On the CPU, where the process runs under an address-space limit
(`RLIMIT_AS`, which makes PyTorch's CPU allocations fail with a recoverable
`DefaultCPUAllocator: can't allocate memory`), that limit is the device's
limit and the process's address space (`/proc/self/status`: `VmSize`) what
is in use. Its peak since `reset_peak` is the address space then plus how
far the resident memory rose above what was resident then (`VmHWM`, whose
high-water mark `reset_peak` resets through `/proc/self/clear_refs`, after
returning the heap's free pages to the system with glibc's `malloc_trim`,
so that a piece reusing freed memory counts too); where the mark cannot be
reset, only a rise above the old one counts (a lower bound). Without such a
limit (and on MPS) nothing is reported: the planner sizes batches from the
first OOM instead.
"""

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
    """The CUDA ordinal of "cuda:N" ("/GPU:N" too) when CUDA is usable, else None."""
    text = device.strip().lstrip("/").lower()
    kind, _, index = text.partition(":")
    if kind not in ("cuda", "gpu") or not torch.cuda.is_available():
        return None
    ordinal = int(index) if index.isdigit() else 0
    return ordinal if ordinal < torch.cuda.device_count() else None


def _is_cpu(device: str) -> bool:
    return device.strip().lstrip("/").lower().partition(":")[0] == "cpu"


def _address_space() -> Optional[Dict[str, int]]:
    """The soft `RLIMIT_AS` and the process's `VmSize`, `VmPeak`, `VmRSS` and
    `VmHWM` in bytes; None without a limit (or off Linux)."""
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
    """Bytes held by tensors (CUDA's caching allocator), or the process's
    address space under `RLIMIT_AS` (CPU); None otherwise."""
    index = _cuda_index(device)
    if index is not None:
        return int(torch.cuda.memory_allocated(index)), int(torch.cuda.max_memory_allocated(index))
    space = _address_space() if _is_cpu(device) else None
    if space is None:
        return None
    current = space["VmSize"]
    reset = _resets.get(device)
    if reset is None:  # no measurement started: the process's peak
        return current, max(current, space["VmPeak"])
    size_then, resident_then = reset
    return current, max(current, size_then + space["VmHWM"] - resident_then)


def memory_limit(device: str) -> Optional[Tuple[int, bool]]:
    """The device's free memory plus what PyTorch already reserved (its cache),
    at most the per-process memory fraction of the device's total where one
    is set; on the CPU the address-space limit (`RLIMIT_AS`) where one is set;
    None otherwise.

    Example:
        >>> memory_limit("cuda:0")  # an idle 16 GB card
        (16928342016, True)
    """
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
    """Reset CUDA's peak; on the CPU under `RLIMIT_AS`, see the module docstring."""
    index = _cuda_index(device)
    if index is not None:
        torch.cuda.reset_peak_memory_stats(index)
        return
    if not _is_cpu(device) or _address_space() is None:
        return
    _trim_heap()
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # the resident high-water mark becomes the resident size
    except OSError:
        pass  # not allowed here: the old mark stays, and only a rise above it counts
    space = _address_space()
    if space is not None:
        _resets[device] = (space["VmSize"], space["VmHWM"])


def _trim_heap() -> None:
    """Return the C heap's free pages to the system (glibc's `malloc_trim`; nothing elsewhere)."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # the process's C library
    if trim is not None:
        trim(0)


def release_cached() -> None:
    """Return PyTorch's cached, unused CUDA blocks to the device (after an OOM)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def conv_columns(model: Any, device: str) -> bool:
    """False: torch's CPU convolutions (oneDNN) were not measured building one."""
    return False


def compiles_per_shape(model: Any) -> bool:
    """False: keras_memfit's steps on torch run eagerly, also where Keras wraps
    its own in `torch.compile` (`jit_compile=True`; see `steps`)."""
    return False

