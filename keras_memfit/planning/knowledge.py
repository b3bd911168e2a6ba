"""What the planner records: `Knowledge` per model (weakly), phase and signature; `Event`s.

An `Event` is one adaptation of the piece size, by a planner or by MemFit, which places
it in its `fit` (`Event.located`).
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from typing import Any, Dict, Hashable, Optional, Tuple


@dataclasses.dataclass
class Knowledge:
    """What is known about one (model, phase, input signature)."""

    largest_ok: int = 0
    smallest_failed: Optional[int] = None
    bytes_per_sample: Optional[float] = None
    limit_floor: int = 0
    growth_frozen: bool = False
    # Where the limit is unknown: bytes a piece proved it may use (the peak
    # memory at an OOM over the memory held before that piece); 0 until an OOM.
    learned_budget: int = 0
    # Steps compiled per shape (XLA): bytes a step needs beyond what is
    # resident, whatever its size (the analytic estimate's gradients and
    # update temporaries), and the size the estimate gave, kept so that a
    # later call reuses the same shapes (see `BatchPlanner._xla_estimate`).
    fixed_extra: int = 0
    analysed: bool = False
    xla_cap: Optional[int] = None


_KNOWLEDGE: "weakref.WeakKeyDictionary[Any, Dict[Hashable, Knowledge]]" = (
    weakref.WeakKeyDictionary()
)


def knowledge_for(model: Any, phase: str, signature: Hashable) -> Knowledge:
    """The shared record for `model` in `phase` at input `signature`."""
    per_model = _KNOWLEDGE.setdefault(model, {})
    return per_model.setdefault((phase, signature), Knowledge())


def forget(model: Any) -> None:
    """Drop everything remembered about `model` (all phases and signatures)."""
    _KNOWLEDGE.pop(model, None)


def _set_by_memfit() -> Any:
    return dataclasses.field(default=None, kw_only=True)


@dataclasses.dataclass
class Event:
    """One adaptation of the batch size, by a planner (and, in `fit`, MemFit).

    Attributes:
        epoch: The `fit` epoch (0 in a standalone `evaluate`/`predict`), or None outside `fit`.
        step: The training batch's index in its epoch, or None.
        kind: "estimate", "oom", "grow" or "remat" (more layers recomputed after one sample
            ran out of memory).
        batch_size: Rows of the incoming batch that was split (MemFit), or None.
        old_split, new_split: Pieces per batch of `batch_size` rows at `old_size` and
            `new_size` (MemFit), or None.
        layers: For "remat", the layers recomputed from now on, else None.
        step_time: For "remat", the estimated step time over that without recomputation.
    """

    epoch: Optional[int] = _set_by_memfit()
    step: Optional[int] = _set_by_memfit()
    phase: str
    kind: str
    batch_size: Optional[int] = _set_by_memfit()
    old_size: Optional[int]
    new_size: int
    old_split: Optional[int] = _set_by_memfit()
    new_split: Optional[int] = _set_by_memfit()
    reason: str
    layers: Optional[Tuple[str, ...]] = dataclasses.field(default=None, kw_only=True)
    step_time: Optional[float] = dataclasses.field(default=None, kw_only=True)

    def located(self, epoch: int, step: int, batch_size: Optional[int]) -> "Event":
        """A copy placed at `epoch` and `step` of `fit`, on a batch of `batch_size` rows."""

        def split(size: Optional[float]) -> Optional[int]:
            if size is None or batch_size is None or math.isinf(size):
                return None
            return math.ceil(batch_size / max(int(size), 1))

        return dataclasses.replace(
            self, epoch=epoch, step=step, batch_size=batch_size,
            old_split=split(self.old_size), new_split=split(self.new_size),
        )
