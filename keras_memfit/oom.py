"""Out-of-memory detection and the error raised when even one sample does not fit.

Detection is a handful of small named predicates, in the manner of toma: each
recognises one way a backend or a library reports running out of memory, and
`is_oom_error` is true when any of them is. Everything else is *not* an OOM and
is re-raised by keras_memfit untouched: same object, same type, same traceback.

The backend-specific forms (TensorFlow's `ResourceExhaustedError` and its
`InternalError` variants; JAX's `JaxRuntimeError` allocation, dispatch, TPU
and YNNPACK forms; torch's allocator errors) live behind the backend seam in `keras_memfit.backend`; the forms shared across backends (host `MemoryError`,
XLA, CUDA/cuBLAS/cuDNN allocation failures) live here.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Optional, Sequence, Tuple

from keras_memfit import backend as _backend

__all__ = [
    "OutOfMemoryError",
    "is_cuda_alloc_failure",
    "is_host_oom",
    "is_oom_error",
    "is_retryable_oom",
    "is_xla_oom",
]

# XLA (TensorFlow with jit_compile, JAX): "RESOURCE_EXHAUSTED: Out of memory
# while trying to allocate 123 bytes."
_XLA_OOM = re.compile(r"RESOURCE_EXHAUSTED:.*(out of memory|failed to allocate)", re.I | re.S)
# CUDA runtime, cuBLAS and cuDNN allocation failures, as TensorFlow and XLA
# surface them inside otherwise generic errors.
_CUDA_ALLOC = re.compile(
    r"CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_ALLOC_FAILED|CUDA_ERROR_OUT_OF_MEMORY"
    r"|cudaErrorMemoryAllocation|CUDA error: out of memory"
)


def is_host_oom(exc: BaseException) -> bool:
    """True for Python's own `MemoryError` (host RAM exhausted).

    Args:
        exc: The exception to classify.

    Returns:
        Whether `exc` is a `MemoryError`.

    Example:
        >>> is_host_oom(MemoryError())
        True
    """
    return isinstance(exc, MemoryError)


def is_xla_oom(exc: BaseException) -> bool:
    """True for XLA's "RESOURCE_EXHAUSTED: Out of memory" reports.

    Args:
        exc: The exception to classify.

    Returns:
        Whether the message is XLA's out-of-memory report.

    Example:
        >>> is_xla_oom(RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 8 bytes"))
        True
    """
    return bool(_XLA_OOM.search(_message(exc)))


def is_cuda_alloc_failure(exc: BaseException) -> bool:
    """True for CUDA runtime, cuBLAS and cuDNN allocation failures.

    Args:
        exc: The exception to classify.

    Returns:
        Whether the message reports a failed CUDA/cuBLAS/cuDNN allocation.

    Example:
        >>> is_cuda_alloc_failure(RuntimeError("CUBLAS_STATUS_ALLOC_FAILED"))
        True
    """
    return bool(_CUDA_ALLOC.search(_message(exc)))


def is_oom_error(exc: BaseException) -> bool:
    """Whether an exception means the device (or host) ran out of memory.

    True for every form the active backend and XLA use to report running out
    of device or host memory: with TensorFlow, `tf.errors.ResourceExhaustedError`
    and the `InternalError` forms "Dst tensor is not initialized" and "failed
    to allocate memory"; with JAX, `jax.errors.JaxRuntimeError` (or the older
    `XlaRuntimeError`) reporting "RESOURCE_EXHAUSTED: Out of memory
    allocating/while trying to allocate N bytes", "INTERNAL: Error
    dispatching computation: Out of memory ...", the TPU's "Allocation
    (size=N) would exceed memory", and "YNNPACK operation failed" only under
    an address-space limit (see `keras_memfit.backend.jax.oom`); with torch,
    `torch.OutOfMemoryError`, the CPU allocator's "DefaultCPUAllocator: can't
    allocate memory" `RuntimeError` (also as Keras re-raises it from a layer),
    cuBLAS/cuDNN allocation failures and "MPS backend out of memory" (see
    `keras_memfit.backend.torch.oom`); XLA's "RESOURCE_EXHAUSTED: Out of memory"; cuBLAS and
    cuDNN allocation failures; and `MemoryError`. False for everything else,
    including `KeyboardInterrupt` and errors that merely mention memory.

    Args:
        exc: The exception to classify.

    Returns:
        True if `exc` reports an out-of-memory condition.

    Raises:
        TypeError: If `exc` is not an exception instance.

    Example:
        >>> import tensorflow as tf
        >>> is_oom_error(tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor"))
        True
        >>> is_oom_error(ValueError("bad shape"))
        False
    """
    if not isinstance(exc, BaseException):
        raise TypeError(
            "is_oom_error expects an exception instance; "
            f"received {type(exc).__name__}: {exc!r}"
        )
    if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit, ...
        return False
    return (
        isinstance(exc, _OutOfMemoryErrorBody)  # whatever the backend's message forms
        or is_host_oom(exc)
        or _backend.get().is_oom_error(exc)
        or is_xla_oom(exc)
        or is_cuda_alloc_failure(exc)
    )


def is_retryable_oom(exc: BaseException) -> bool:
    """Whether `exc` is an OOM that running smaller pieces may avoid.

    `is_oom_error`, less keras_memfit's own `OutOfMemoryError`, which it
    raises once it judged an OOM final (one sample does not fit, or an
    optimizer update ran out of memory): the retry loops pass that one on.

    Example:
        >>> is_retryable_oom(MemoryError())
        True
    """
    return is_oom_error(exc) and not isinstance(exc, _OutOfMemoryErrorBody)


def _message(exc: BaseException) -> str:
    message = getattr(exc, "message", None)
    return message if isinstance(message, str) else str(exc)


_ADVICE = (
    "What to do next: look at which layers hold the memory "
    "(`keras_memfit.memory_report(model, batch_size)`, or model.summary()); keep "
    "oversized embedding/input layers on the CPU (`keras_memfit.place(model)`, "
    "or `with keras.device('cpu:0')` around those layers); use mixed precision "
    "(keras.mixed_precision.set_global_policy('mixed_float16')); free other "
    "models or tensors held on the device; or use a smaller model."
)


class _OutOfMemoryErrorBody:
    """Raised when even a single sample does not fit in device memory.

    It subclasses the active backend's own out-of-memory error (with
    TensorFlow, `tf.errors.ResourceExhaustedError`; with JAX,
    `jax.errors.JaxRuntimeError`, a `RuntimeError`), so existing
    `except tf.errors.ResourceExhaustedError:` (or `except
    jax.errors.JaxRuntimeError:`) code keeps catching it. The
    class is made on first use (`from keras_memfit.oom import
    OutOfMemoryError`), so importing this module needs no backend. The
    backend error that caused it is chained as `__cause__`.

    Args:
        model_name: Name of the model that ran out of memory.
        phase: What was running: "predict", "evaluate" or "train".
        batch_shape: Shapes of the inputs of the one-sample batch that failed.
        device: The device whose memory ran out, when known.
        detail: Extra sentence about this failure, placed before the advice.

    Attributes:
        model_name: Name of the model that ran out of memory.
        phase: What was running: "predict", "evaluate" or "train".
        batch_shape: Shapes of the one-sample batch that failed.
        device: The device whose memory ran out, when known.

    Example:
        >>> try:
        ...     safe_predict(huge_model, x)
        ... except OutOfMemoryError as err:
        ...     print(err.phase, err.batch_shape)
    """

    def __init__(
        self,
        model_name: str,
        phase: str,
        batch_shape: Sequence[Any] = (),
        device: Optional[str] = None,
        detail: str = "",
    ) -> None:
        self.model_name = model_name
        self.phase = phase
        self.batch_shape = tuple(batch_shape)
        self.device = device
        self.detail = detail
        where = f" on {device}" if device else ""
        shapes = ", ".join(str(tuple(s)) for s in self.batch_shape) or "unknown"
        message = (
            f"Model '{model_name}' ran out of memory in {phase}{where} even with "
            f"a batch of a single sample (input shape {shapes}): one sample "
            "does not fit in the memory left on the device."
        )
        if detail:
            message += f" {detail}"
        message += f" {_ADVICE}"
        _backend.get().init_oom_error(self, message)

    def __reduce__(self) -> Tuple[Any, ...]:  # picklable despite the backend base's __init__
        return (
            type(self),
            (self.model_name, self.phase, self.batch_shape, self.device, self.detail),
        )


def _make_out_of_memory_error() -> type:
    """`OutOfMemoryError`: the body above on the active backend's OOM error bases."""
    bases = _backend.get().oom_error_bases()
    return type(
        "OutOfMemoryError",
        (_OutOfMemoryErrorBody, *bases),
        {
            "__module__": __name__,
            "__qualname__": "OutOfMemoryError",
            "__doc__": _OutOfMemoryErrorBody.__doc__,
        },
    )


if TYPE_CHECKING:
    OutOfMemoryError = _OutOfMemoryErrorBody
else:

    def __getattr__(name: str) -> Any:
        if name == "OutOfMemoryError":
            cls = globals()["OutOfMemoryError"] = _make_out_of_memory_error()
            return cls
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
