"""JAX's own out-of-memory forms, each a predicate over the error's class and message.

XLA's CPU kernels also raise `YNNPACK operation failed` for other failures: it counts as an OOM
only under an address-space limit (`RLIMIT_AS`).
"""

from __future__ import annotations

import re
from typing import Tuple

_RESOURCE_EXHAUSTED = re.compile(
    r"RESOURCE_EXHAUSTED:.*Out of memory (allocating|while trying to allocate) \d+ bytes",
    re.S,
)
_DISPATCH = re.compile(
    r"INTERNAL:.*Error dispatching computation:.*Out of memory "
    r"(allocating|while trying to allocate) \d+ bytes",
    re.S,
)
_TPU_ALLOCATION = re.compile(
    r"RESOURCE_EXHAUSTED:.*Allocation \(size=\d+\) would exceed memory", re.S
)
# jax's runtime error class, and jaxlib's of before jax 0.4.36.
_RUNTIME_ERROR_NAMES = ("JaxRuntimeError", "XlaRuntimeError")


def _runtime_error_class() -> type:
    import jax

    return jax.errors.JaxRuntimeError


def is_jax_runtime_error(exc: BaseException) -> bool:
    """Whether `exc` is JAX's runtime error (jaxlib's old one by class name: its module is gone)."""
    if isinstance(exc, _runtime_error_class()):
        return True
    return isinstance(exc, RuntimeError) and any(
        cls.__name__ in _RUNTIME_ERROR_NAMES for cls in type(exc).__mro__
    )


def _message(exc: BaseException) -> str:
    return str(exc)


def is_allocation_oom(exc: BaseException) -> bool:
    """XLA's allocator ran out: `RESOURCE_EXHAUSTED: Out of memory ...`."""
    return is_jax_runtime_error(exc) and bool(_RESOURCE_EXHAUSTED.search(_message(exc)))


def is_dispatch_oom(exc: BaseException) -> bool:
    """A computation using a failed one's output: `INTERNAL: Error dispatching computation`."""
    return is_jax_runtime_error(exc) and bool(_DISPATCH.search(_message(exc)))


def is_tpu_allocation_oom(exc: BaseException) -> bool:
    """TPU: `RESOURCE_EXHAUSTED: ... Allocation (size=N) would exceed memory`."""
    return is_jax_runtime_error(exc) and bool(_TPU_ALLOCATION.search(_message(exc)))


_YNNPACK = "YNNPACK operation failed"


def _address_space_limited() -> bool:
    try:
        import resource
    except ImportError:  # not POSIX
        return False
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return soft != resource.RLIM_INFINITY


def is_ynnpack_oom_under_address_limit(exc: BaseException) -> bool:
    """`INTERNAL: YNNPACK operation failed`, only under an `RLIMIT_AS` limit."""
    return (
        is_jax_runtime_error(exc)
        and _YNNPACK in _message(exc)
        and _address_space_limited()
    )


def is_oom_error(exc: BaseException) -> bool:
    return (
        is_allocation_oom(exc)
        or is_dispatch_oom(exc)
        or is_tpu_allocation_oom(exc)
        or is_ynnpack_oom_under_address_limit(exc)
    )


def oom_error_bases() -> Tuple[type, ...]:
    return (_runtime_error_class(),)


def init_oom_error(err: BaseException, message: str) -> None:
    _runtime_error_class().__init__(err, message)
