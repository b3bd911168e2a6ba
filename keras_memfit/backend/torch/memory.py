"""Memory statistics and limits of PyTorch's devices, for the planner.

On CUDA, from PyTorch's caching allocator: `torch.cuda.memory_allocated`
(bytes held by tensors), `torch.cuda.max_memory_allocated` since
`torch.cuda.reset_peak_memory_stats`, and as the limit what the allocator
can still reach: the device's free memory (`torch.cuda.mem_get_info`) plus
what it already reserved (`torch.cuda.memory_reserved`), bounded by a
per-process memory fraction where one is set
(`torch.cuda.set_per_process_memory_fraction`). The CPU (and MPS) report
nothing: the planner sizes batches from the first OOM instead.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch


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


def memory_stats(device: str) -> Optional[Tuple[int, int]]:
    """Bytes held by tensors (CUDA's caching allocator); None off CUDA."""
    index = _cuda_index(device)
    if index is None:
        return None
    return int(torch.cuda.memory_allocated(index)), int(torch.cuda.max_memory_allocated(index))


def memory_limit(device: str) -> Optional[Tuple[int, bool]]:
    """The device's free memory plus what PyTorch already reserved (its cache),
    at most the per-process memory fraction of the device's total where one
    is set; None off CUDA.

    Example:
        >>> memory_limit("cuda:0")  # an idle 16 GB card
        (16928342016, True)
    """
    index = _cuda_index(device)
    if index is None:
        return None
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
    index = _cuda_index(device)
    if index is not None:
        torch.cuda.reset_peak_memory_stats(index)


def release_cached() -> None:
    """Return PyTorch's cached, unused CUDA blocks to the device (after an OOM)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def compiles_per_shape(model: Any) -> bool:
    """False: keras_memfit's steps on torch run eagerly, also where Keras wraps
    its own in `torch.compile` (`jit_compile=True`; see `steps`)."""
    return False

