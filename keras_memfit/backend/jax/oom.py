"""JAX's own out-of-memory forms, each a predicate over the error's class and message.

XLA's CPU kernels also raise `YNNPACK operation failed` for other failures: it counts as an OOM
only under an address-space limit (`RLIMIT_AS`).
"""

from __future__ import annotations

import re
import resource
from typing import Tuple

import jax

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


def is_jax_runtime_error(exc: BaseException) -> bool:
    """Whether `exc` is JAX's runtime error, by class name (jaxlib's old one's module is gone)."""
    return isinstance(exc, RuntimeError) and any(
        cls.__name__ in _RUNTIME_ERROR_NAMES for cls in type(exc).__mro__
    )


def is_allocation_oom(exc: BaseException) -> bool:
    """XLA's allocator ran out: `RESOURCE_EXHAUSTED: Out of memory ...`."""
    return is_jax_runtime_error(exc) and bool(_RESOURCE_EXHAUSTED.search(str(exc)))


def is_dispatch_oom(exc: BaseException) -> bool:
    """A computation using a failed one's output: `INTERNAL: Error dispatching computation`."""
    return is_jax_runtime_error(exc) and bool(_DISPATCH.search(str(exc)))


def is_tpu_allocation_oom(exc: BaseException) -> bool:
    """TPU: `RESOURCE_EXHAUSTED: ... Allocation (size=N) would exceed memory`."""
    return is_jax_runtime_error(exc) and bool(_TPU_ALLOCATION.search(str(exc)))


def _address_space_limited() -> bool:
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return soft != resource.RLIM_INFINITY


def is_ynnpack_oom_under_address_limit(exc: BaseException) -> bool:
    """`INTERNAL: YNNPACK operation failed`, only under an `RLIMIT_AS` limit."""
    return (
        is_jax_runtime_error(exc)
        and "YNNPACK operation failed" in str(exc)
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
    return (jax.errors.JaxRuntimeError,)


def init_oom_error(err: BaseException, message: str) -> None:
    jax.errors.JaxRuntimeError.__init__(err, message)
