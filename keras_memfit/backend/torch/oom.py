"""PyTorch's own out-of-memory forms, and the bases of `OutOfMemoryError`.

Each form is a small named predicate over the exception's class and message;
`is_oom_error` is true when any of them is. PyTorch reports most runtime
failures as a plain `RuntimeError`, so the class alone says little: each
predicate but the first also needs the allocator's own message.

- CUDA's caching allocator raises `torch.OutOfMemoryError` (the same class as
  `torch.cuda.OutOfMemoryError`, a `RuntimeError`; it exists without a GPU).
- The CPU allocator raises a plain `RuntimeError`: `[enforce fail at
  alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory:
  you tried to allocate N bytes. Error code 12 (Cannot allocate memory)`.
  Raised inside a layer, Keras re-raises it as the same class with
  "Exception encountered when calling Conv2D.call()" prepended.
- Aligned host allocations inside a kernel (NNPACK's and torch's native
  convolution buffers) report `posix_memalign failed:Cannot allocate memory
  (12)` (ENOMEM).
- cuBLAS and cuDNN report their workspace allocation failures as
  `RuntimeError`s naming `CUBLAS_STATUS_ALLOC_FAILED` or
  `CUDNN_STATUS_ALLOC_FAILED`.
- Apple's MPS backend: `RuntimeError: MPS backend out of memory (MPS
  allocated: ..., other allocations: ..., max allowed: ...)`.

Nothing else is an OOM: an error that merely mentions memory (a device-side
assert, "an illegal memory access was encountered") propagates untouched.
"""

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
    """The message of a `RuntimeError`, "" for any other exception."""
    return str(exc) if isinstance(exc, RuntimeError) else ""


def is_cuda_allocator_oom(exc: BaseException) -> bool:
    """CUDA's caching allocator ran out: `torch.OutOfMemoryError`."""
    return isinstance(exc, torch.OutOfMemoryError)


def is_cpu_allocator_oom(exc: BaseException) -> bool:
    """The CPU allocator ran out: `RuntimeError: ... DefaultCPUAllocator: can't allocate memory ...`."""
    return bool(_CPU_ALLOCATOR.search(_runtime_message(exc)))


def is_aligned_alloc_oom(exc: BaseException) -> bool:
    """A kernel's aligned host allocation failed: `posix_memalign failed:Cannot allocate memory (12)`."""
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
    """PyTorch's own OOM forms: CUDA's allocator, the CPU allocator, aligned host allocations, cuBLAS, cuDNN, MPS."""
    return (
        is_cuda_allocator_oom(exc)
        or is_cpu_allocator_oom(exc)
        or is_aligned_alloc_oom(exc)
        or is_cublas_alloc_oom(exc)
        or is_cudnn_alloc_oom(exc)
        or is_mps_oom(exc)
    )


def oom_error_bases() -> Tuple[type, ...]:
    """Bases for `OutOfMemoryError`: `torch.OutOfMemoryError` (a `RuntimeError`), so
    `except torch.OutOfMemoryError`, `except torch.cuda.OutOfMemoryError` and
    `except RuntimeError` still catch it."""
    return (torch.OutOfMemoryError,)


def init_oom_error(err: BaseException, message: str) -> None:
    torch.OutOfMemoryError.__init__(err, message)
