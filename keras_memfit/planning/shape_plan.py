"""Planning for steps compiled once per piece shape (XLA): few shapes, sized without probes.

On XLA (JAX, and TensorFlow with `jit_compile=True`) every new piece size
compiles the step again: seconds for a CNN on a GPU, minutes for a large
model. So `planner.BatchPlanner`, where the backend's `compiles_per_shape`
says so, sizes pieces from what costs no compilation, the analytic estimate
(`analytic_estimate`, the one `memory_report` shows) corrected by OOMs,
instead of probe sizes, and evens each size out over the rows it splits
(`even_size`): a chunk runs as pieces of one size and one remainder.
Where nothing about memory is known (no statistics, no limit), an OOM
shrinks by `blind_size` rather than by half: each halving would cost an
OOM and a compilation.
"""

from __future__ import annotations

import logging
import math
import weakref
from typing import Any, Dict, Optional, Tuple

logger = logging.getLogger("keras_memfit")


def even_size(rows: int, size: float) -> int:
    """The smallest size that runs `rows` rows in as many pieces as `size` does.

    Example:
        >>> even_size(28000, 3700)  # 8 pieces: 7 of 3500 and one of 3500
        3500
    """
    return math.ceil(rows / math.ceil(rows / size))


# Where no memory statistics or limit exist, the share of the failed piece's
# estimated need the next piece is sized to: an OOM proves only that the
# memory is below what the failed size needs, not how far below; halving
# pays an OOM (and a compilation) per factor of 2, this shrink one per factor
# of 8 in memory, so two OOMs cover a 64x overshoot (measured under hidden
# address-space limits: the seed's CNN fits at 1/8 of 28,000 rows, a KerasHub
# BERT at 1/16 of 1,024).
BLIND_SHARE = 1 / 8
BLIND_FLOOR = 64  # never below 1/64 of the failed size in one step


def blind_size(failed: int, estimate: Optional[Tuple[float, int]]) -> int:
    """The size to try after an OOM at `failed` rows where nothing about memory is known.

    Args:
        failed: The rows of the piece that ran out of memory.
        estimate: (bytes per sample, fixed extra bytes) of the analytic
            estimate, or None: then the rows themselves are scaled.

    Returns:
        The largest size whose estimated need is within `BLIND_SHARE` of the
        failed size's (its fixed part counted), at least `failed //
        BLIND_FLOOR` and 1.

    Example:
        >>> blind_size(1024, (4e6, 0))
        128
    """
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
    """Compute `model`'s analytic estimates now, for the planners made later.

    MemFit calls it when `fit` begins: inside Keras's JAX training loop the
    variables live in Keras's state tuple (their values are not readable),
    so a planner made there could not trace the model.
    """
    try:
        per_model = _ANALYTIC.setdefault(model, {})
    except TypeError:  # not weakly referable
        return
    for training in (True, False):
        if training not in per_model:
            per_model[training] = _analyse(model, training)


def analytic_estimate(model: Any, phase: str) -> Optional[Tuple[float, int]]:
    """(bytes per sample, bytes needed beyond what is resident) of one step, or None.

    From `keras_memfit.analysis` (`fixed + n * per_sample`, the estimate
    `memory_report` shows), computed from the model's symbolic trace, which
    costs no compilation, once per model (see `prepare`). The fixed part
    less the weights (and the optimizer slots, when they exist) is what the
    step allocates whatever its size: for training, the gradients and the
    update's temporaries. None where the model cannot be analysed (not
    built, not traceable).
    """
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
