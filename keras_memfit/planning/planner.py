"""Choosing the piece size: estimate first, pay few OOMs, remember, grow back.

Probes or the analytic estimate size the pieces within `MARGIN` of free memory; an OOM halves
(or less), a known size is remembered (`knowledge`), and growth follows `GROW_AFTER` fits
(ARCHITECTURE.md, "Rules the code follows").
"""

from __future__ import annotations

import logging
import math
from typing import Any, Hashable, List, Optional, Tuple

from keras_memfit import backend as _backend
from keras_memfit._internal.model_state import stateful_layers
from keras_memfit.planning.knowledge import Event, Knowledge, forget, knowledge_for
from keras_memfit.planning.replica_memory import ReplicaMemory
from keras_memfit.planning.shape_plan import analytic_estimate, blind_size, even_size

logger = logging.getLogger("keras_memfit")

__all__ = ["BatchPlanner", "Event", "Knowledge", "forget", "knowledge_for"]

PROBE_SIZES = (16, 64)
MIN_PROBE_REQUEST = 128
GROW_AFTER = 8
# Share of free memory a batch may use: fragmentation makes the peak grow faster
# than linearly near the limit.
MARGIN = 0.6
# A piece is near the free memory (probed first) unless the analytic estimate of its
# need is below 1/NEAR of it: that estimate can be well below the real peak.
NEAR = 16


class BatchPlanner:
    """Plans the piece size for one input signature during one call.

    `requested`: the largest piece size (None: unbounded); `events` receives an `Event` per
    adaptation; `probe`: "first" (inference) or "after_oom" (training: the batch runs whole first).
    """

    def __init__(
        self,
        model: Any,
        phase: str,
        signature: Hashable,
        requested: Optional[int],
        events: Optional[List[Event]] = None,
        probe: str = "first",
    ) -> None:
        if probe not in ("first", "after_oom"):
            raise ValueError(f'probe must be "first" or "after_oom"; received probe={probe!r}')
        backend = _backend.get()
        self.phase = phase
        self.requested = requested
        self._largest = math.inf if requested is None else requested
        self.events = events if events is not None else []
        self._label = f"{phase} on model '{getattr(model, 'name', type(model).__name__)}'"
        self.stateful = stateful_layers(model)  # its batches run as Keras runs them, whole
        devices = backend.replica_devices(model) or (backend.compute_device(),)
        self._memory = ReplicaMemory(backend, devices)
        key = signature if len(devices) == 1 else (signature, devices)
        self._k = knowledge_for(model, phase, key)
        self.device = self._memory.name
        self._limit = self._memory.limit
        self._exact = self._limit is not None and self._limit[1]  # a limit that is known
        self._stats_ok = self._memory.stats() is not None
        self._probes: List[int] = []
        self._samples: List[Tuple[int, int]] = []
        self._baseline: Optional[int] = None
        self._streak = 0
        self._growing = False
        self._batch_rows: Optional[int] = None  # set by start_batch (MemFit)
        self._multiple = backend.piece_multiple()
        self._xla = bool(backend.compiles_per_shape(model))
        self._even = self._xla  # the next size is evened against the rows left
        k = self._k
        if self._xla and not k.analysed and not self.stateful:
            k.analysed = True
            analytic = analytic_estimate(model, phase)
            if analytic is not None and not k.bytes_per_sample:
                k.bytes_per_sample, k.fixed_extra = analytic
        if k.smallest_failed is not None and k.largest_ok:  # an earlier call found the boundary
            k.growth_frozen = True
        fresh = k.largest_ok == 0 and k.smallest_failed is None and k.bytes_per_sample is None
        # XLA never probes: each probe size would compile the step again.
        self._probe_after_oom = fresh and self._stats_ok and not self._xla and not self.stateful
        self._probe_first = self._probe_after_oom and probe == "first" and self._exact
        self._analytic = analytic_estimate(model, phase) if self._probe_first else None
        self._size = self._initial_size()

    def free_bytes(self) -> Optional[int]:
        """Bytes free on the fullest replica where its limit is known, else None."""
        return self._memory.free()

    @property
    def measuring(self) -> bool:
        """Whether the next pieces measure their memory (each must run alone)."""
        return bool(self._probes)

    # ------------------------------------------------------------------ sizes
    def next_size(self, rows: Optional[int] = None) -> float:
        """The size to try next (`math.inf` when unbounded); `rows`: those left in the chunk."""
        if self._probe_first:
            self._probe_first = False
            if self._near(min(rows or math.inf, self._largest)):
                self._probes = list(PROBE_SIZES)
                self._probe_after_oom = False
        if (self._even and self._size < (rows or 0) and not self._probes
                and self._size < self._largest):
            self._even = False
            self._size = max(self._granular(even_size(rows, self._size)), 1)
        size = self._probes[0] if self._probes else self._size
        return self._granular(size)

    def _near(self, rows: float) -> bool:
        """Whether `rows` rows may need over 1/`NEAR` of free memory."""
        if rows < MIN_PROBE_REQUEST:
            return False
        free = self._memory.free()
        if self._analytic is None or free is None or math.isinf(rows):
            return True
        per_sample, fixed = self._analytic
        return (fixed + rows * per_sample) * NEAR > free

    def _granular(self, size: float) -> float:
        """`size` down to a multiple of `piece_multiple`."""
        m = self._multiple
        if m == 1 or math.isinf(size) or size < m:
            return size
        return int(size) - int(size) % m

    def _initial_size(self) -> float:
        cap = self.ceiling()
        k = self._k
        if self._exact and k.bytes_per_sample and cap < self._largest:
            reason = f"estimated {k.bytes_per_sample / 2**20:.2f} MiB per sample"
            free = self._memory.free()
            if free is not None:
                reason += f", {free / 2**20:.0f} MiB free on {self.device}"
            self._record("estimate", self.requested, int(cap), reason)
        return cap

    def ceiling(self) -> float:
        """The largest size the planner would currently use."""
        k = self._k
        cap = self._largest
        if k.smallest_failed is not None:
            cap = min(cap, k.smallest_failed - 1)
        if k.growth_frozen and k.largest_ok:
            cap = min(cap, k.largest_ok)
        if self._exact:
            cap = min(cap, (self._xla_estimate(cap) if self._xla else self.estimate()) or math.inf)
        cap = min(cap, self._learned_estimate(1.0) or math.inf)
        return max(1, cap)

    def _xla_estimate(self, cap: float) -> Optional[int]:
        """The estimate's cap where steps compile per shape (kept while roughly valid), or None."""
        k = self._k
        if self.phase == "train" and k.smallest_failed is None:
            whole = self.estimate(margin=1.0)
            if whole is not None and (whole >= cap or self._nothing_fits()):
                return None
        estimate = self.estimate()
        if estimate is None:
            return None
        if k.xla_cap is None or estimate < k.xla_cap * MARGIN:
            k.xla_cap = estimate
        return k.xla_cap

    def _nothing_fits(self) -> bool:
        k = self._k
        free = self._memory.free(self._limit[0])  # the limit is known (`ceiling`)
        return free is not None and free - k.fixed_extra < k.bytes_per_sample

    def estimate(self, limit: Optional[int] = None, margin: float = MARGIN) -> Optional[int]:
        """Largest batch estimated to fit within `margin` of the free memory, or None."""
        k = self._k
        if limit is None and self._limit is not None:
            limit = self._limit[0]
        if not k.bytes_per_sample or limit is None:
            return None
        free = self._memory.free(limit)
        if free is None:
            return None
        return max(1, int((free - k.fixed_extra) * margin // k.bytes_per_sample))

    # -------------------------------------------------------------- attempts
    def started(self, size: int) -> None:
        """Call right before running a piece."""
        if self._stats_ok and not self._exact:  # what is held before the piece, for `failed`
            stats = self._memory.stats()
            self._baseline = stats[0] if stats is not None else None
        if self._probes:
            self._note_floor()
            self._memory.begin_measure()

    def succeeded(self, size: int, full: bool) -> None:
        """Call after a piece ran; `full` if it was not clipped."""
        k = self._k
        k.largest_ok = max(k.largest_ok, size)
        if self._probes:
            self._take_probe(size)
            return
        self._growing = False
        # MemFit's growth counts batches (finish_batch); under XLA a grown size and its
        # remainder would compile again.
        if self._batch_rows is not None or self._xla or not full or self._size >= self._largest:
            return
        ceiling = self._growth_ceiling()
        if ceiling is not None:
            new = self._grown(ceiling)
            self._resize("grow", int(self._size), new, (
                f"{GROW_AFTER} batches in a row fitted at batch_size={int(self._size)}"))
            self._growing = True

    def _growth_ceiling(self) -> Optional[float]:
        """Count a fit; at the `GROW_AFTER`th in a row, the ceiling where it is above the size."""
        self._streak += 1
        if self._streak < GROW_AFTER:
            return None
        self._streak = 0
        ceiling = self.ceiling()
        return ceiling if ceiling > self._size else None

    def _grown(self, ceiling: float) -> float:
        new = min(ceiling, self._size * 2)
        if self._k.smallest_failed is not None:  # bisect towards the failure
            new = min(new, self._size + max(1, (ceiling - self._size) // 2))
        return new

    # ---------------------------------------------------------- MemFit batches
    def start_batch(self, rows: int) -> None:
        """Call before one Keras batch's pieces (MemFit): growth then counts batches."""
        self._batch_rows = rows

    def finish_batch(self) -> None:
        """Call after the batch ran; growth here lowers its number of pieces."""
        n = self._batch_rows
        if not n or self._probes or self._size >= n:
            return
        ceiling = self._growth_ceiling()
        if ceiling is None:
            return
        size = int(self._size)
        old_split = math.ceil(n / size)
        # At least one piece fewer (a size that keeps the split gains nothing).
        new_split = min(math.ceil(n / min(self._grown(ceiling), n)), old_split - 1)
        new = math.ceil(n / new_split)
        # Up to a multiple of `piece_multiple`: pieces laid out over the devices (`_granular`).
        new = math.ceil(new / self._multiple) * self._multiple
        if new > ceiling:
            return  # one piece fewer is already above what may fit
        self._resize("grow", size, new, (
            f"{GROW_AFTER} batches in a row fitted as {old_split} pieces of up to "
            f"{size} samples; trying {new_split} pieces of up to {new}"))
        self._growing = True
        self._even = False  # already even over the batch

    def failed(self, size: int) -> bool:
        """Call after a piece ran out of memory; False: no smaller size will be tried."""
        if self.stateful:
            return False
        k = self._k
        self._note_floor()
        # Where the limit is unknown, the first OOM proves a budget: the peak at the failure
        # over what was held before the piece (at the failure, its buffers still count).
        if not self._exact and self._baseline is not None:
            k.learned_budget = max(k.learned_budget, k.limit_floor - self._baseline)
        k.smallest_failed = size if k.smallest_failed is None else min(k.smallest_failed, size)
        self._streak = 0
        if size <= self._multiple:
            return False
        self._probes = []
        limit = self._limit[0] if self._exact else (k.limit_floor or None)
        free = self._memory.free(limit) if limit is not None else None
        if free is not None and k.bytes_per_sample and free > k.fixed_extra:
            # Corrected so that `size` no longer fits.
            k.bytes_per_sample = max(k.bytes_per_sample, (free - k.fixed_extra) / size)
        k.xla_cap = None  # estimated again from the corrected estimate
        self._even = self._xla
        if self._probe_after_oom and not k.bytes_per_sample and size >= MIN_PROBE_REQUEST:
            self._probe_after_oom = False
            self._probes = list(PROBE_SIZES)
            self._record(
                "oom", size, self._probes[0],
                f"out of memory at batch_size={size}; measuring memory on pieces of "
                f"{' and '.join(map(str, PROBE_SIZES))} samples to size the rest",
            )
            return True
        if self._growing:  # back to the size that worked, and stay there
            k.growth_frozen = True
            self._growing = False
            new = min(k.largest_ok, size - 1)
        else:
            new = size // 2
            estimate = self._learned_estimate(MARGIN) or self.estimate(limit)
            if estimate is None and self._xla and not self._stats_ok:
                # Nothing about memory is known: shrink far (see `blind_size`).
                bps = k.bytes_per_sample
                estimate = blind_size(size, (bps, k.fixed_extra) if bps else None)
            if estimate is not None:
                new = min(new, estimate)
            if k.largest_ok and k.growth_frozen:
                new = min(new, k.largest_ok)
        new = self._granular(max(1, new))
        self._resize("oom", size, new, (
            f"out of memory at batch_size={size}; retrying the same samples at "
            f"batch_size={new}"))
        return True

    # ----------------------------------------------------------------- probes
    def _take_probe(self, size: int) -> None:
        growth = self._memory.growth()
        if growth is not None:
            self._samples.append((size, growth))
        self._probes.pop(0)
        if self._probes and len({s for s, _ in self._samples}) < 2:
            return  # one more probe, at another size
        self._probes = []
        if self._samples:
            (s1, m1), (s2, m2) = self._samples[0], self._samples[-1]
            per_sample = m2 / s2 if s2 else 0.0
            if s2 != s1:
                per_sample = max(per_sample, (m2 - m1) / (s2 - s1))
            if per_sample > 0:
                self._k.bytes_per_sample = per_sample
        # After an OOM where the limit is unknown: within MARGIN of what it proved.
        self._size = min(self._initial_size(), self._learned_estimate(MARGIN) or math.inf)

    # ------------------------------------------------- unknown-limit learning
    def _learned_estimate(self, margin: float) -> Optional[int]:
        k = self._k
        if self._exact or not k.learned_budget or not k.bytes_per_sample:
            return None
        return max(1, int(k.learned_budget * margin // k.bytes_per_sample))

    def _note_floor(self) -> None:
        stats = self._memory.stats()
        if stats is not None:
            self._k.limit_floor = max(self._k.limit_floor, stats[1])

    def _resize(self, kind: str, old: int, new: float, reason: str) -> None:
        self._record(kind, old, int(new), reason)
        self._size = new

    def _record(self, kind: str, old: Optional[int], new: int, reason: str) -> None:
        """Add an `Event` and log it (an OOM as a warning)."""
        event = Event(phase=self.phase, kind=kind, old_size=old, new_size=new, reason=reason)
        self.events.append(event)
        if kind == "estimate":
            instead = f" instead of {old}" if old is not None else ""
            reason = f"using batch_size={new}{instead} ({reason})"
        level = logging.WARNING if kind == "oom" else logging.INFO
        logger.log(level, "%s: %s", self._label, reason)

