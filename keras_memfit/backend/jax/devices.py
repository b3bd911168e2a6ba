"""Naming JAX's devices; placing variables and calls (`place`) is not implemented yet.

Device names are "platform:id" ("cpu:0", "gpu:1"), as JAX prints them.
`keras_memfit.place` (layers kept on the host) needs to move variables and
pin calls and their gradients to a device; on JAX that would mean host
memory kinds and sharding annotations, which keras_memfit does not do yet:
those functions raise `NotImplementedError`.
"""

from __future__ import annotations

from typing import Any, List, Optional

import jax

from keras_memfit.backend._placement_refused import PlacementRefused

_NOT_YET = (
    "keras_memfit.place is not implemented for the JAX backend yet ({what}); "
    "run the model without placement, or use KERAS_BACKEND=tensorflow for place()."
)
# `keras_memfit.place` cannot keep layers on another device here (its functions refuse).
PLACES_LAYERS = False


def _name(device: Any) -> str:
    return f"{device.platform}:{device.id}"


def host_device() -> str:
    """The host device: "cpu:0"."""
    return _name(jax.devices("cpu")[0])


def list_accelerators() -> List[str]:
    """Names of the non-CPU devices JAX sees ("gpu:0", "tpu:0", ...)."""
    return [_name(d) for d in jax.devices() if d.platform != "cpu"]


def canonical_device(name: str) -> Optional[str]:
    """`name` as "platform:id" ("/GPU:0" -> "gpu:0"), or None if unparsable."""
    text = name.strip().lstrip("/").lower().replace("device:", "")
    platform, _, index = text.partition(":")
    if not platform or not (index or "0").isdigit():
        return None
    return f"{platform}:{int(index or 0)}"


def device_exists(name: str) -> bool:
    """Whether `name` (canonical) is one of JAX's devices."""
    try:
        devices = jax.devices() + jax.devices("cpu")
    except RuntimeError:
        devices = jax.devices()
    return any(_name(d) == name for d in devices)


def variable_device(variable: Any) -> Optional[str]:
    """Device of a Keras variable's value ("cpu:0"); None if not created or sharded."""
    value = getattr(variable, "_value", None)
    if value is None:
        return None
    devices = list(value.devices()) if hasattr(value, "devices") else []
    return _name(devices[0]) if len(devices) == 1 else None


# The five placement functions, each refusing with the reason above.
device_scope, move_variable, creating_on, call_on_device, follow_variable_devices = (
    PlacementRefused(_NOT_YET).functions())
