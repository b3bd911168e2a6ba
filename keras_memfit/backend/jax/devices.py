"""Naming JAX's devices: "platform:id" ("cpu:0", "gpu:1"), as JAX prints them."""

from __future__ import annotations

from typing import Any, List, Optional

import jax


def _name(device: Any) -> str:
    return f"{device.platform}:{device.id}"


def host_device() -> str:
    return _name(jax.devices("cpu")[0])


def list_accelerators() -> List[str]:
    return [_name(d) for d in jax.devices() if d.platform != "cpu"]


def canonical_device(name: str) -> Optional[str]:
    """`name` as "platform:id" ("/GPU:0" -> "gpu:0"), or None."""
    text = name.strip().lstrip("/").lower().replace("device:", "")
    platform, _, index = text.partition(":")
    if not platform or not (index or "0").isdigit():
        return None
    return f"{platform}:{int(index or 0)}"


def device_exists(name: str) -> bool:
    try:
        devices = jax.devices() + jax.devices("cpu")
    except RuntimeError:
        devices = jax.devices()
    return any(_name(d) == name for d in devices)


def variable_device(variable: Any) -> Optional[str]:
    """The device of a Keras variable's value; None if not created or sharded."""
    value = getattr(variable, "_value", None)
    if value is None:
        return None
    devices = list(value.devices()) if hasattr(value, "devices") else []
    return _name(devices[0]) if len(devices) == 1 else None

