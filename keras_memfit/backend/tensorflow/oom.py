"""TensorFlow's own out-of-memory forms, and the bases of `OutOfMemoryError`."""

from __future__ import annotations

from typing import Tuple

import tensorflow as tf

_INTERNAL_OOM_MESSAGES = (
    "Dst tensor is not initialized",
    "failed to allocate memory",
)


def is_oom_error(exc: BaseException) -> bool:
    """TensorFlow's own OOM forms: ResourceExhaustedError and two InternalErrors."""
    if isinstance(exc, tf.errors.ResourceExhaustedError):
        return True
    if isinstance(exc, tf.errors.InternalError):
        message = exc.message if isinstance(exc.message, str) else str(exc)
        lowered = message.lower()
        return any(m.lower() in lowered for m in _INTERNAL_OOM_MESSAGES)
    return False


def oom_error_bases() -> Tuple[type, ...]:
    return (tf.errors.ResourceExhaustedError,)


def init_oom_error(err: BaseException, message: str) -> None:
    tf.errors.ResourceExhaustedError.__init__(err, None, None, message)
