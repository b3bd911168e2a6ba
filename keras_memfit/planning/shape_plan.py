"""Planning for steps compiled once per piece shape (XLA): few shapes, sized without probes.

With nothing known about memory an OOM shrinks by `blind_size`, not by half.
"""

from __future__ import annotations

import logging
import math
import weakref
from typing import Any, Dict, Optional, Tuple

logger = logging.getLogger("keras_memfit")


def even_size(rows: int, size: float) -> int:
    """The smallest size that runs `rows` rows in as many pieces as `size` does."""
    return math.ceil(rows / math.ceil(rows / size))


# The share of the failed piece's estimated need the next piece is sized to, where nothing
# about memory is known: one OOM (and compilation) per factor of 8, not per halving.
BLIND_SHARE = 1 / 8
BLIND_FLOOR = 64  # never below 1/64 of the failed size in one step


def blind_size(failed: int, estimate: Optional[Tuple[float, int]]) -> int:
    """The size to try after an OOM at `failed` rows; `estimate`: (bytes per sample, fixed)."""
    rows = failed * BLIND_SHARE
    if estimate is not None and estimate[0] > 0:
        per_sample, fixed = estimate
        rows = ((fixed + failed * per_sample) * BLIND_SHARE - fixed) / per_sample
    return max(1, failed // BLIND_FLOOR, int(rows))


# model -> {training: (bytes per sample, fixed extra) or None}, held weakly.
_ANALYTIC: "weakref.WeakKeyDictionary[Any, Dict[bool, Optional[Tuple[float, int]]]]" = (
    weakref.WeakKeyDictionary()
)


def prepare(model: Any) -> None:
    """Compute `model`'s analytic estimates now (inside Keras's JAX loop it cannot be traced)."""
    try:
        per_model = _ANALYTIC.setdefault(model, {})
    except TypeError:  # not weakly referable
        return
    for training in (True, False):
        if training not in per_model:
            per_model[training] = _analyse(model, training)


def analytic_estimate(model: Any, phase: str) -> Optional[Tuple[float, int]]:
    """(bytes per sample, bytes beyond the resident weights and slots), or None; cached."""
    training = phase == "train"
    try:
        per_model = _ANALYTIC.setdefault(model, {})
    except TypeError:
        return _analyse(model, training)
    if per_model.get(training) is None:  # not yet, or failed before: try (again)
        per_model[training] = _analyse(model, training)
    return per_model[training]


def _analyse(model: Any, training: bool) -> Optional[Tuple[float, int]]:
    from keras_memfit import analysis  # analysis traces the model: only when needed

    try:
        result = analysis.analyse(model)
        _, memory, _ = result.peak(training=training)
    except Exception as err:  # noqa: BLE001 - no estimate: the planner learns from OOMs
        logger.debug("no analytic memory estimate for %s: %s", getattr(model, "name", model), err)
        return None
    if memory.bytes_per_sample <= 0:
        return None
    resident = memory.param_bytes + (memory.slot_bytes if result.slots_resident else 0)
    return float(memory.bytes_per_sample), max(0, memory.fixed_bytes - resident)
