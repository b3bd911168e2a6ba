"""Naming torch's devices: "type:index" ("cpu:0", "cuda:1"), the index always given."""

from __future__ import annotations

from typing import Any, List, Optional

import torch


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
    """Device of a Keras variable's value; None if not created."""
    value = getattr(variable, "_value", None)
    device = getattr(value, "device", None)
    if device is None:
        return None
    return f"{device.type}:{device.index or 0}"

