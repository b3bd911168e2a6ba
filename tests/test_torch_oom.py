"""The torch backend's OOM forms: each named predicate on real exception objects.

The CPU allocator's error is the real one (an allocation of a petabyte);
CUDA's `torch.OutOfMemoryError` is constructed (its class exists without a
GPU) with the caching allocator's message; cuBLAS, cuDNN and MPS failures
are `RuntimeError`s with the messages PyTorch raises there. These run in the
suite's own process (only `torch` is imported, whatever Keras's backend);
the Keras-wrapped form is checked in a child under KERAS_BACKEND=torch
(tests/test_torch_backend.py).
"""

from __future__ import annotations

import pickle

import pytest

from tests.torch_support import requires_torch

pytestmark = requires_torch


def _cpu_allocator_error() -> RuntimeError:
    import torch

    try:
        torch.empty(1 << 50, dtype=torch.uint8)
    except RuntimeError as err:
        return err
    raise AssertionError("a petabyte was allocated: the test proves nothing")


CUDA_MESSAGE = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 15.77 GiB "
    "of which 1.07 GiB is free. Of the allocated memory 13.40 GiB is allocated by PyTorch, and "
    "1.02 GiB is reserved by PyTorch but unallocated."
)
# Seen under an address-space limit, in torch's native convolution (oneDNN off).
ALIGNED_MESSAGE = (
    "Exception encountered when calling Conv2D.call().\n\n"
    "\x1b[1mposix_memalign failed:Cannot allocate memory (12)\x1b[0m\n\n"
    "Arguments received by Conv2D.call():\n  \u2022 inputs=torch.Tensor(shape=torch.Size("
    "[3000, 28, 28, 1]), dtype=float32)"
)
CUBLAS_MESSAGE = "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"
CUDNN_MESSAGE = "cuDNN error: CUDNN_STATUS_ALLOC_FAILED"
MPS_MESSAGE = (
    "MPS backend out of memory (MPS allocated: 17.00 GB, other allocations: 1.20 GB, max "
    "allowed: 18.13 GB). Tried to allocate 1.00 GB on private pool."
)


def test_each_form_is_recognised_by_its_own_predicate():
    import torch

    from keras_memfit.backend.torch import oom

    cases = {
        oom.is_cuda_allocator_oom: torch.OutOfMemoryError(CUDA_MESSAGE),
        oom.is_cpu_allocator_oom: _cpu_allocator_error(),
        oom.is_aligned_alloc_oom: RuntimeError(ALIGNED_MESSAGE),
        oom.is_cublas_alloc_oom: RuntimeError(CUBLAS_MESSAGE),
        oom.is_cudnn_alloc_oom: RuntimeError(CUDNN_MESSAGE),
        oom.is_mps_oom: RuntimeError(MPS_MESSAGE),
    }
    for predicate, error in cases.items():
        assert predicate(error), (predicate.__name__, str(error)[:100])
        assert oom.is_oom_error(error)
        others = [p for p in cases if p is not predicate and p is not oom.is_cuda_allocator_oom]
        assert not any(p(error) for p in others), predicate.__name__


def test_cuda_out_of_memory_is_one_class_and_a_runtime_error():
    import torch

    from keras_memfit.backend.torch import oom

    assert torch.cuda.OutOfMemoryError is torch.OutOfMemoryError
    assert issubclass(torch.OutOfMemoryError, RuntimeError)
    assert oom.is_cuda_allocator_oom(torch.cuda.OutOfMemoryError("anything"))


@pytest.mark.parametrize("error", [
    RuntimeError("CUDA error: an illegal memory access was encountered"),
    RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x2)"),
    RuntimeError("CUDA error: device-side assert triggered"),
    RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED"),
    RuntimeError("could not create a primitive"),  # oneDNN: also unsupported configurations
    RuntimeError("posix_memalign failed: Invalid argument (22)"),
    RuntimeError("Expected all tensors to be on the same device, but found cuda:0 and cpu"),
    ValueError("DefaultCPUAllocator: can't allocate memory"),  # not torch's class
    TypeError("MPS backend out of memory"),
    KeyError("CUBLAS_STATUS_ALLOC_FAILED"),
])
def test_nothing_else_is_an_oom(error):
    from keras_memfit.backend.torch import oom

    assert not oom.is_oom_error(error)


def test_out_of_memory_error_bases_catch_it_as_torch_and_runtime_errors():
    import torch

    from keras_memfit.backend.torch import oom

    assert oom.oom_error_bases() == (torch.OutOfMemoryError,)
    err = torch.OutOfMemoryError.__new__(torch.OutOfMemoryError)
    oom.init_oom_error(err, "one sample does not fit")
    assert str(err) == "one sample does not fit"
    assert isinstance(err, RuntimeError)
    assert str(pickle.loads(pickle.dumps(err))) == "one sample does not fit"
