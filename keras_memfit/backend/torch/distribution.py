"""torch's distribution answers: one process on one device; `torch.distributed` refused."""

from __future__ import annotations

from typing import Any, Hashable, Optional, Tuple

import keras
import torch


def _process_group() -> Any:
    """`torch.distributed` where a process group is initialized, else None."""
    dist = getattr(torch, "distributed", None)
    return dist if dist is not None and dist.is_available() and dist.is_initialized() else None


def check_not_distributed(what: str) -> None:
    """Raise `NotImplementedError` naming `what` when `torch.distributed` is in use."""
    dist = _process_group()
    if dist is not None:
        raise NotImplementedError(
            f"{what} on the torch backend runs in one process on one device; received a "
            f"model in a torch.distributed process group (world size "
            f"{dist.get_world_size()}, e.g. DistributedDataParallel), whose processes "
            "would have to split every batch alike. Run it without torch.distributed, "
            "or use KERAS_BACKEND=tensorflow with tf.distribute.MirroredStrategy."
        )


def training_layout(model: keras.Model) -> None:
    """None: one device; refused under `torch.distributed` (DDP)."""
    check_not_distributed("MemFit")
    return None


def distribution_of(model: keras.Model) -> Optional[str]:
    """"torch.distributed (world size N)" when a process group is initialized, else None."""
    dist = _process_group()
    return None if dist is None else f"torch.distributed (world size {dist.get_world_size()})"


def replica_devices(model: Any) -> Tuple[str, ...]:
    """(): every piece is planned for `compute_device()` alone."""
    return ()


def step_variant(model: keras.Model) -> Hashable:
    """Every step runs on Keras's one device."""
    return "one device"


def piece_multiple() -> int:
    """1: any piece size runs."""
    return 1

