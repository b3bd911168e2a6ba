"""Which cheap top-level layers `place` keeps on the host so that the rest fits the accelerator."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import keras

from keras_memfit._internal import keras_compat as _keras_compat
from keras_memfit._internal.units import format_bytes
from keras_memfit.analysis.model import ModelAnalysis, Row

# By class name too: other libraries' lookups (keras-rs's DistributedEmbedding, say).
_CHEAP_CLASSES = ("Embedding", "Hashing", "Lookup", "CategoryEncoding", "Discretization")
# Keras's layers that read their weights by index (a gather), never multiply them.
_LOOKUP_LAYERS = (keras.layers.Embedding, keras.layers.Hashing, keras.layers.IntegerLookup,
                  keras.layers.StringLookup, keras.layers.CategoryEncoding,
                  keras.layers.Discretization, keras.layers.HashedCrossing)


def layer_bytes(analysis: ModelAnalysis, layers: List[Any]) -> Dict[str, int]:
    """Weights plus optimizer slots of each of `layers` that has weights, by name."""
    return {layer.name: analysis.weights_bytes(layer.weights) for layer in layers if layer.weights}


def is_cheap(layer: Any, row: Optional[Row] = None) -> bool:
    """Whether `layer` uses each weight at most once per sample: a lookup, by FLOPs, or by class."""
    if isinstance(layer, _LOOKUP_LAYERS):
        return True
    if row is not None and row.flops is not None and row.params:
        return row.flops <= 2 * row.params * 1.01
    name = type(layer).__name__
    if any(key in name for key in _CHEAP_CLASSES):
        return True
    if isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense)):
        shape = _input_shape(layer)
        return shape is not None and len(shape) == 2
    return False


def _input_shape(layer):
    try:
        return tuple(layer.input.shape)
    except Exception:
        return _keras_compat.built_input_shape(layer)


def choose(
    analysis: ModelAnalysis,
    layers: List[Any],
    sizes: Dict[str, int],
    budget: Optional[int],
    *,
    weight_share: float,
    oversized_bytes: int,
    dominant_share: float,
) -> Tuple[List[Any], str]:
    """The cheap layers to pin to the host (in model order), and why (placement.py's constants)."""
    candidates = [layer for layer in layers
                  if layer.name in sizes and is_cheap(layer, analysis.first_row(layer))]
    total = sum(sizes.values())
    if budget is None:
        chosen = [c for c in candidates if sizes[c.name] >= oversized_bytes]
        if not chosen:
            return [], (
                "accelerator memory unknown and no cheap layer reaches "
                f"{format_bytes(oversized_bytes)}; nothing pinned (pass budget= to choose by size)"
            )
        return chosen, (
            f"accelerator memory unknown: pinned the cheap layers of at least "
            f"{format_bytes(oversized_bytes)} of weights and slots"
        )
    allowed = int(budget * weight_share)
    if total <= allowed:
        return [], (
            f"weights and slots ({format_bytes(total)}) fit in {weight_share:.0%} of the budget "
            f"({format_bytes(allowed)}); nothing pinned"
        )

    def score(layer):
        return sizes[layer.name] / max(analysis.crossing([layer]), 1)

    chosen, rest = [], total
    for layer in sorted(candidates, key=score, reverse=True):
        if rest <= allowed:
            break
        chosen.append(layer)
        rest -= sizes[layer.name]
    if rest <= allowed:
        # Keep only what the fit needs: drop the smallest pins that are not needed.
        for layer in sorted(chosen, key=lambda c: sizes[c.name]):
            if rest + sizes[layer.name] <= allowed:
                chosen.remove(layer)
                rest += sizes[layer.name]
    else:
        # Cannot fit anyway: pin only the dominant layers, not every small cheap one.
        for layer in [c for c in chosen if sizes[c.name] < dominant_share * total]:
            chosen.remove(layer)
            rest += sizes[layer.name]
    chosen.sort(key=layers.index)
    names = ", ".join(c.name for c in chosen) or "none"
    over = (f"weights and slots ({format_bytes(total)}) exceed {weight_share:.0%} of the budget "
            f"({format_bytes(allowed)}); ")
    if rest <= allowed:
        return chosen, (
            f"{over}pinned the cheap layers with the most bytes per byte crossing ({names}), "
            f"leaving {format_bytes(rest)} on the accelerator"
        )
    return chosen, (
        f"{over}pinning the cheap layers ({names}) still leaves {format_bytes(rest)}: the "
        "compute-heavy layers themselves do not fit (cheap layers under "
        f"{dominant_share:.0%} of the total stay on the accelerator)"
    )
