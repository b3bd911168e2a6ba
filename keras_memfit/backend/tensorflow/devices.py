"""Naming TensorFlow's devices."""

from __future__ import annotations

from typing import Any, Optional

import keras
import tensorflow as tf

_HOST = "/CPU:0"


def host_device() -> str:
    """The host device that pinned layers live on."""
    return _HOST


def list_accelerators() -> list:
    """Canonical names ("/GPU:0", ...) of the logical GPUs TensorFlow sees."""
    return [canonical_device(d.name) for d in tf.config.list_logical_devices("GPU")]


def canonical_device(name: str) -> Optional[str]:
    """`name` as "/TYPE:index" ("/device:GPU:0" -> "/GPU:0"), or None if unparsable."""
    try:
        spec = tf.DeviceSpec.from_string(name)
    except (ValueError, TypeError):
        return None
    if not spec.device_type:
        return None
    return f"/{spec.device_type.upper()}:{spec.device_index or 0}"


def device_exists(name: str) -> bool:
    """Whether `name` (canonical) is one of TensorFlow's logical devices."""
    return any(canonical_device(d.name) == name for d in tf.config.list_logical_devices())


def variable_device(variable: Any) -> Optional[str]:
    """Canonical device of a Keras (or tf) variable; None if not created yet."""
    value = variable._value if isinstance(variable, keras.Variable) else variable
    if value is None:
        return None
    return canonical_device(value.device)
