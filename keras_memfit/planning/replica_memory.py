"""The memory of the devices a piece runs on, for the planner: one device, or every replica's.

Without a distribution strategy a piece runs on the backend's
`compute_device()`. Under a `tf.distribute.MirroredStrategy` each piece is
split across the replicas (see the backend's `replica_devices`), every
replica runs its share at once, and one replica out of memory fails the
whole piece. So the planner sizes a piece for the worst replica: the budget
is the smallest free memory among the replicas' devices and the measured
peak growth the largest (one split, agreed before any replica runs it).
Piece sizes stay global (rows of the whole piece): a replica running half
of a piece shows half the growth per global row, so the same estimate
arithmetic gives a piece twice as large on two devices. Where the replicas
share one allocator (logical devices of one CPU), every device reports the
same numbers and the arithmetic is the one-device one.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple


class ReplicaMemory:
    """Memory statistics and limits of a group of devices, reduced to the worst one.

    Args:
        backend: The backend package (`memory_stats`, `memory_limit`, `reset_peak`).
        devices: The devices each piece runs on (at least one).

    Example:
        >>> memory = ReplicaMemory(backend, ("GPU:0", "GPU:1"))
        >>> memory.free()  # bytes free on the fuller of the two
        7516192768
    """

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
        """(current, peak) bytes: the largest among the devices; None when one cannot tell."""
        each = self._each()
        if each is None:
            return None
        return max(s[0] for s in each), max(s[1] for s in each)

    def free(self, limit: Optional[int] = None) -> Optional[int]:
        """Bytes free on the device with the least free memory, or None when unknown.

        Args:
            limit: A limit to assume for every device instead of the known
                ones (a lower bound learned from an OOM).
        """
        each = self._each()
        if each is None:
            return None
        if limit is not None:
            return min(limit - s[0] for s in each)
        if self._limits is None:
            return None
        return min(lim - s[0] for lim, s in zip(self._limits, each))

    def begin_measure(self) -> None:
        """Reset every device's peak and note what each holds before a piece runs."""
        for device in self.devices:
            self._backend.reset_peak(device)
        each = self._each()
        self._before = None if each is None else [s[0] for s in each]

    def growth(self) -> Optional[int]:
        """The largest peak growth of a device since `begin_measure`, or None when unknown."""
        each = self._each()
        if each is None or self._before is None:
            return None
        return max(max(0, s[1] - before) for s, before in zip(each, self._before))
