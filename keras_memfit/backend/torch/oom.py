"""PyTorch's own out-of-memory forms (most told by message), and the bases of `OutOfMemoryError`."""

from __future__ import annotations

import re
from typing import Tuple

import torch

_CPU_ALLOCATOR = re.compile(
    r"DefaultCPUAllocator: (can't allocate memory|not enough memory)", re.I
)
_ALIGNED_ALLOC = re.compile(r"posix_memalign failed: ?Cannot allocate memory", re.I)
_CUBLAS_ALLOC = "CUBLAS_STATUS_ALLOC_FAILED"
_CUDNN_ALLOC = "CUDNN_STATUS_ALLOC_FAILED"
_MPS_OOM = "MPS backend out of memory"


def _runtime_message(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, RuntimeError) else ""


def is_cuda_allocator_oom(exc: BaseException) -> bool:
    """CUDA's caching allocator ran out: `torch.OutOfMemoryError`."""
    return isinstance(exc, torch.OutOfMemoryError)


def is_cpu_allocator_oom(exc: BaseException) -> bool:
    """The CPU allocator ran out: `... DefaultCPUAllocator: can't allocate memory ...`."""
    return bool(_CPU_ALLOCATOR.search(_runtime_message(exc)))


def is_aligned_alloc_oom(exc: BaseException) -> bool:
    """A kernel's aligned host allocation failed: `posix_memalign failed:Cannot allocate memory`."""
    return bool(_ALIGNED_ALLOC.search(_runtime_message(exc)))


def is_cublas_alloc_oom(exc: BaseException) -> bool:
    """cuBLAS could not allocate its workspace: `CUBLAS_STATUS_ALLOC_FAILED`."""
    return _CUBLAS_ALLOC in _runtime_message(exc)


def is_cudnn_alloc_oom(exc: BaseException) -> bool:
    """cuDNN could not allocate: `CUDNN_STATUS_ALLOC_FAILED`."""
    return _CUDNN_ALLOC in _runtime_message(exc)


def is_mps_oom(exc: BaseException) -> bool:
    """Apple's MPS backend ran out: `RuntimeError: MPS backend out of memory ...`."""
    return _MPS_OOM in _runtime_message(exc)


def is_oom_error(exc: BaseException) -> bool:
    """Any of PyTorch's own OOM forms."""
    return (
        is_cuda_allocator_oom(exc)
        or is_cpu_allocator_oom(exc)
        or is_aligned_alloc_oom(exc)
        or is_cublas_alloc_oom(exc)
        or is_cudnn_alloc_oom(exc)
        or is_mps_oom(exc)
    )


def oom_error_bases() -> Tuple[type, ...]:
    """`torch.OutOfMemoryError` (a `RuntimeError`), so existing `except` clauses still catch it."""
    return (torch.OutOfMemoryError,)


def init_oom_error(err: BaseException, message: str) -> None:
    torch.OutOfMemoryError.__init__(err, message)
