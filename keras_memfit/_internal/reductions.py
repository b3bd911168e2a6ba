"""How a micro-batch weighs in its batch's loss, by the model's loss reductions."""

from __future__ import annotations

from typing import List, Optional, Tuple

import keras
import numpy as np

from keras_memfit._internal import keras_compat as _keras_compat
from keras_memfit._internal.batches import leaves, num_rows

ROWS = "rows"
ONE = "one"
SAMPLE_WEIGHTS = "sample weights"
_HOW = {
    "sum_over_batch_size": ROWS,
    "mean": ROWS,
    "sum": ONE,
    None: ONE,
    "none": ONE,
    "mean_with_sample_weight": SAMPLE_WEIGHTS,
}


def loss_reductions(model: keras.Model) -> List[Optional[str]]:
    """One reduction per compiled loss; strings and plain functions: "sum_over_batch_size"."""
    return [
        loss.reduction if isinstance(loss, keras.losses.Loss) else "sum_over_batch_size"
        for loss in keras.tree.flatten(getattr(model, "loss", None))
        if loss is not None
    ]


def _regularized(model: keras.Model) -> bool:
    """Whether `model` has a weight or activity regularizer (a loss counted once per batch)."""
    if any(getattr(w, "regularizer", None) is not None for w in model.trainable_weights):
        return True
    return any(
        getattr(layer, "activity_regularizer", None) is not None
        for layer in _keras_compat.all_layers(model)
    )


def weighting(model: keras.Model) -> Tuple[Optional[str], Optional[str]]:
    """`(how, None)`, `how` one of `ROWS`, `ONE`, `SAMPLE_WEIGHTS`; `(None, why)` if none fits."""
    reductions = loss_reductions(model)
    kinds = {_HOW[r] for r in reductions} or {ROWS}
    if len(kinds) > 1:
        return None, (
            f"model '{model.name}' has losses reduced with {_names(reductions)}, which weigh "
            "a micro-batch differently (by its rows, by 1, by its sample weights), and one "
            "weight per micro-batch cannot serve them all"
        )
    how = kinds.pop()
    if how == SAMPLE_WEIGHTS and len(reductions) > 1:
        return None, (
            f"model '{model.name}' has {len(reductions)} losses reduced with "
            "'mean_with_sample_weight', each divided by its own output's sample weights, "
            "which one weight per micro-batch matches only when they are the same"
        )
    if how == ONE and _regularized(model):
        return None, (
            f"model '{model.name}' has losses reduced with {_names(reductions)}, whose "
            "micro-batches add up (weight 1 each), and regularizers, which count once per "
            "batch and would count once per micro-batch"
        )
    return how, None


def _names(reductions: List[Optional[str]]) -> str:
    return ", ".join(sorted({repr(r) for r in reductions}))


def sample_weight_sum(chunk: tuple) -> Optional[float]:
    """The sum of `chunk`'s sample weights, or None without any."""
    found = [leaf for leaf in leaves(chunk[2]) if leaf is not None]
    if not found:
        return None
    return float(sum(np.sum(keras.ops.convert_to_numpy(leaf), dtype=np.float64)
                     for leaf in found))


def weights(how: str, part: tuple, whole: tuple) -> Tuple[float, float]:
    """`(weight, loss_factor)`: `part`'s gradient weight in `whole`, its row-weighted loss factor.

    `loss_factor` is `weight x whole's rows / part's rows`, so the tracker logs Keras's loss.
    """
    rows, total = num_rows(part[0]), num_rows(whole[0])
    if not rows:
        return 0.0, 0.0
    if how == ROWS:
        return rows / total, 1.0
    if how == ONE:
        return 1.0, total / rows
    own, summed = sample_weight_sum(part), sample_weight_sum(whole)
    weight = rows / total if summed is None else (own / summed if summed else 0.0)
    return weight, weight * total / rows
