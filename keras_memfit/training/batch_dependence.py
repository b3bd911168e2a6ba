"""What makes a split batch differ from the unsplit one, and MemFit's warnings about it.

`SplitWarnings` warns once per run; a coupled model is still split (docs/training.md).
"""

from __future__ import annotations

import logging
from typing import Any, List, Optional

import keras
import numpy as np

from keras_memfit import backend as _backend
from keras_memfit._internal import batches as _batches
from keras_memfit._internal import cache as _cache
from keras_memfit._internal import keras_compat as _keras_compat

logger = logging.getLogger("keras_memfit")

# Attributes that set how much a random layer draws; all 0: it draws nothing.
RATE_ATTRIBUTES = ("rate", "stddev", "dropout", "recurrent_dropout")
# The relative difference still counted as float rounding (kernels that reduce in
# another order, e.g. on GPU); coarser for 16-bit compute.
RELATIVE_TOLERANCE = 1e-5
RELATIVE_TOLERANCE_16_BIT = 1e-2


def batch_dependent_layers(model: keras.Model) -> List[Any]:
    """The trainable BatchNormalizations, and layers with a seed generator that draw."""
    found = []
    for layer in _keras_compat.all_layers(model):
        if layer is model:
            continue
        if isinstance(layer, keras.layers.BatchNormalization):
            if layer.trainable:
                found.append(layer)
        elif any(isinstance(value, keras.random.SeedGenerator)
                 for value in vars(layer).values()) and _draws(layer):
            found.append(layer)
    return found


def _draws(layer: Any) -> bool:
    rates = [getattr(layer, name, None) for name in RATE_ATTRIBUTES]
    rates = [rate for rate in rates if isinstance(rate, (int, float))]
    return not rates or any(rate > 0 for rate in rates)


def couples_rows(model: keras.Model, x: Any) -> Optional[bool]:
    """Whether the model's output for a row depends on the other rows of its batch.

    Compares two rows of `x` run together with each beside a copy of itself (same shapes,
    same rounding); None when it cannot tell (or where steps compile per shape).
    """
    if _batches.num_rows(x) < 2 or _backend.get().compiles_per_shape(model):
        return None
    try:
        _backend.get().materialize(model)  # JAX inside Keras's loops: the weights
        first, second = (_numpy(_batches.rows(x, i, i + 1)) for i in (0, 1))
        if all(np.array_equal(a, b) for a, b in zip(_leaves(first), _leaves(second))):
            return None
        together = _forward(model, _stacked(first, second))
        beside_itself = [_forward(model, _stacked(row, row)) for row in (first, second)]
    except Exception as exc:  # a diagnostic only: the split goes on without it
        logger.debug("MemFit: could not check whether model '%s' couples the rows of a "
                     "batch: %s: %s", model.name, type(exc).__name__, exc)
        return None
    tolerance = RELATIVE_TOLERANCE
    if keras.backend.standardize_dtype(model.dtype_policy.compute_dtype) in (
            "float16", "bfloat16"):
        tolerance = RELATIVE_TOLERANCE_16_BIT
    compared = False
    for both, one, two in zip(together, *beside_itself):
        if not both.shape[:1] == one.shape[:1] == two.shape[:1] == (2,):
            continue  # not one row per sample
        alone = np.stack([one[0], two[1]])
        scale = max(np.max(np.abs(both)), np.max(np.abs(alone)))
        compared = True
        if np.max(np.abs(both - alone)) > tolerance * scale:
            return True
    return False if compared else None


def _numpy(x: Any) -> Any:
    return keras.tree.map_structure(
        lambda leaf: leaf if isinstance(leaf, np.ndarray) else keras.ops.convert_to_numpy(leaf), x
    )


def _leaves(x: Any) -> List[Any]:
    return [leaf for leaf in keras.tree.flatten(x) if leaf is not None]


def _stacked(first: Any, second: Any) -> Any:
    return keras.tree.map_structure(lambda a, b: np.concatenate([a, b]), first, second)


def _forward(model: keras.Model, x: Any) -> List[np.ndarray]:
    """The model's floating outputs on `x` as float64, each call from the same state."""
    with keras.StatelessScope():
        outputs = model(x, training=False)
    arrays = []
    for leaf in keras.tree.flatten(outputs):
        if keras.ops.is_tensor(leaf) or isinstance(leaf, np.ndarray):
            array = keras.ops.convert_to_numpy(leaf)
            if "float" in keras.backend.standardize_dtype(array.dtype):
                arrays.append(array.astype(np.float64))
    return arrays


class SplitWarnings:
    """The WARNINGs MemFit logs once per run, when it first splits a batch."""

    def __init__(self, model: keras.Model) -> None:
        self.model = model
        self._batch_statistics = False
        self._coupling = False

    def accumulated(self) -> None:
        """A training batch is accumulated: warn of batch-dependent layers, loss scaling."""
        if not self._batch_statistics:
            self._batch_statistics = True
            warn_batch_statistics(self.model)
            warn_loss_scale(self.model)

    def split(self, x: Any) -> None:
        """A batch with inputs `x` is run as pieces: warn if the model couples its rows."""
        if not self._coupling:
            self._coupling = True
            # Checked once per model: later runs reuse the answer.
            if _cache.per_model(self.model, "couples_rows", lambda: couples_rows(self.model, x)):
                warn_coupling(self.model)


def warn_batch_statistics(model: keras.Model) -> None:
    layers = batch_dependent_layers(model)
    if not layers:
        return
    names = ", ".join(f"{layer.name} ({type(layer).__name__})" for layer in layers)
    logger.warning(
        "MemFit: model '%s' has layers that depend on how a batch is split: %s. Its batch "
        "is now accumulated as micro-batches: each of these layers sees each micro-batch "
        "on its own (BatchNormalization normalises with the micro-batch's statistics and "
        "updates its moving statistics once per micro-batch; random layers draw a mask per "
        "micro-batch), so the update is not exactly the unsplit batch's. "
        "MemFit(mode=\"shrink\") would instead train each piece as its own step, as Keras "
        "does with that smaller batch_size (more optimizer steps).",
        model.name, names,
    )


def warn_loss_scale(model: keras.Model) -> None:
    if not isinstance(getattr(model, "optimizer", None), keras.optimizers.LossScaleOptimizer):
        return
    logger.warning(
        "MemFit: model '%s' trains with a LossScaleOptimizer (mixed precision), and its "
        "batch is now accumulated as micro-batches. Their summed gradient goes through the "
        "optimizer's own rule (not finite: the update is skipped and the loss scale "
        "halved), but whether float16 overflows depends on the batch size: a micro-batch "
        "may stay finite where the whole batch would overflow, so the skipped steps and "
        "the loss scale can differ from the unsplit batch's.",
        model.name,
    )


def warn_coupling(model: keras.Model) -> None:
    logger.warning(
        "MemFit: model '%s' couples the rows of a batch: a row's output changes with the "
        "other rows in its batch (its call reduces over the batch axis, e.g. "
        "ops.tensordot(a, b, 2) where a per-row ops.sum(a * b, axis=-1) was meant). A batch "
        "MemFit splits therefore cannot give the unsplit batch's result, in either mode "
        "(plain Keras too gives other results at another batch_size). If the coupling is a "
        "bug, reduce per row in the model's call; if it is meant, the batch is part of the "
        "model: use a batch_size that fits.",
        model.name,
    )
