"""The memory of the devices a piece runs on, for the planner: one device, or every replica's.

One replica's OOM fails the whole piece, so it is sized for the worst replica.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple


class ReplicaMemory:
    """Memory statistics and limits of a group of devices, reduced to the worst one."""

    def __init__(self, backend: Any, devices: Sequence[str]) -> None:
        if not devices:
            raise ValueError(
                f"ReplicaMemory needs at least one device; received devices={devices!r}"
            )
        self._backend = backend
        self.devices: Tuple[str, ...] = tuple(devices)
        self.name = ", ".join(self.devices)
        limits = [backend.memory_limit(d) for d in self.devices]
        self.limit: Optional[Tuple[int, bool]] = None
        self._limits: Optional[List[int]] = None
        if all(limit is not None for limit in limits):
            self._limits = [limit[0] for limit in limits]
            self.limit = (min(self._limits), all(limit[1] for limit in limits))
        self._before: Optional[List[int]] = None

    def _each(self) -> Optional[List[Tuple[int, int]]]:
        stats = [self._backend.memory_stats(d) for d in self.devices]
        return None if any(s is None for s in stats) else stats

    def stats(self) -> Optional[Tuple[int, int]]:
        """(current, peak) bytes, the largest among the devices, or None."""
        each = self._each()
        if each is None:
            return None
        return max(s[0] for s in each), max(s[1] for s in each)

    def free(self, limit: Optional[int] = None) -> Optional[int]:
        """Least bytes free on a device (under `limit`, if given, for every device), or None."""
        limits = self._limits if limit is None else [limit] * len(self.devices)
        each = self._each()
        if each is None or limits is None:
            return None
        return min(lim - s[0] for lim, s in zip(limits, each))

    def begin_measure(self) -> None:
        """Reset every device's peak and note what each holds before a piece runs."""
        for device in self.devices:
            self._backend.reset_peak(device)
        each = self._each()
        self._before = None if each is None else [s[0] for s in each]

    def growth(self) -> Optional[int]:
        """The largest peak growth of a device since `begin_measure`, or None."""
        each = self._each()
        if each is None or self._before is None:
            return None
        return max(max(0, s[1] - before) for s, before in zip(each, self._before))
