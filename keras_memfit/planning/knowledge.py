"""What the planner records: `Knowledge` per model (weakly), phase and signature; `Event`s."""

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
    learned_budget: int = 0  # where the limit is unknown: what the first OOM proved
    # XLA: bytes a step needs beyond what is resident, whatever its size, and the size
    # the estimate gave, kept so that a later call reuses the same shapes.
    fixed_extra: int = 0
    analysed: bool = False
    xla_cap: Optional[int] = None


_KNOWLEDGE: "weakref.WeakKeyDictionary[Any, Dict[Hashable, Knowledge]]" = (
    weakref.WeakKeyDictionary()
)


def knowledge_for(model: Any, phase: str, signature: Hashable) -> Knowledge:
    per_model = _KNOWLEDGE.setdefault(model, {})
    return per_model.setdefault((phase, signature), Knowledge())


def forget(model: Any) -> None:
    """Drop everything remembered about `model`."""
    _KNOWLEDGE.pop(model, None)


def _set_by_memfit() -> Any:
    return dataclasses.field(default=None, kw_only=True)


@dataclasses.dataclass
class Event:
    """One adaptation of the batch size, by a planner (and, in `fit`, MemFit).

    `kind`: "estimate", "oom", "grow" or "remat"; `epoch`, `step`, `batch_size` and the splits
    (pieces per batch at `old_size` and `new_size`) are set by MemFit (`located`).
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
        """A copy placed at `epoch` and `step`, on a batch of `batch_size` rows."""

        def split(size: Optional[float]) -> Optional[int]:
            if size is None or batch_size is None or math.isinf(size):
                return None
            return math.ceil(batch_size / max(int(size), 1))

        return dataclasses.replace(
            self, epoch=epoch, step=step, batch_size=batch_size,
            old_split=split(self.old_size), new_split=split(self.new_size),
        )
