"""Naming torch's devices; placing variables and calls (`place`) is not implemented.

Device names are "type:index" ("cpu:0", "cuda:1"), as `torch.device` has
them with the index always given. `keras_memfit.place` (layers kept on the
host) would need a layer's variables on the CPU while Keras's torch backend
converts every input and creates every variable on its one device
(`keras.src.backend.torch.core.get_device`), moving tensors back there at
each op: there is no clean way to keep a layer's computation on the host, so
those functions raise `NotImplementedError` naming the backend.
"""

from __future__ import annotations

from typing import Any, List, Optional

import torch

from keras_memfit.backend._placement_refused import PlacementRefused

_NOT_YET = (
    "keras_memfit.place is not implemented for the torch backend ({what}): Keras's "
    "torch backend runs every layer on its one device, so a layer cannot be kept on "
    "the CPU; run the model without placement, or use KERAS_BACKEND=tensorflow for "
    "place()."
)
# `keras_memfit.place` cannot keep layers on another device here (its functions refuse).
PLACES_LAYERS = False


def host_device() -> str:
    """The host device: "cpu:0"."""
    return "cpu:0"


def list_accelerators() -> List[str]:
    """Names of the accelerators torch sees ("cuda:0", ..., or "mps:0")."""
    found = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    mps = getattr(torch.backends, "mps", None)
    if not found and mps is not None and mps.is_available():
        found.append("mps:0")
    return found


def canonical_device(name: str) -> Optional[str]:
    """`name` as "type:index" ("/GPU:0" -> "cuda:0", "cpu" -> "cpu:0"), or None if unparsable."""
    text = name.strip().lstrip("/").lower().replace("device:", "")
    kind, _, index = text.partition(":")
    kind = {"gpu": "cuda"}.get(kind, kind)
    if kind not in ("cpu", "cuda", "mps") or not (index or "0").isdigit():
        return None
    return f"{kind}:{int(index or 0)}"


def device_exists(name: str) -> bool:
    """Whether `name` (canonical) is one of torch's devices."""
    return name == host_device() or name in list_accelerators()


def variable_device(variable: Any) -> Optional[str]:
    """Device of a Keras variable's value ("cpu:0", "cuda:0"); None if not created."""
    value = getattr(variable, "_value", None)
    device = getattr(value, "device", None)
    if device is None:
        return None
    return f"{device.type}:{device.index or 0}"


# The five placement functions, each refusing with the reason above.
device_scope, move_variable, creating_on, call_on_device, follow_variable_devices = (
    PlacementRefused(_NOT_YET).functions())
