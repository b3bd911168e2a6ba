"""What a compiled Keras model holds, read through Keras's public API alone.

Backend-neutral helpers that every backend's steps and the analysis share:
the small state a failed train step may have touched, an optimizer's slot
variables for one weight, and the stateful layers (whose batches
keras_memfit never splits).
"""

from __future__ import annotations

from typing import Any, List, Tuple

import keras
import numpy as np

from keras_memfit._internal import keras_compat as _keras_compat


def stateful_layers(model: keras.Model) -> Tuple[str, ...]:
    """The names of the layers of `model` built with `stateful=True` (stateful RNNs).

    Such a layer carries its state from one batch to the next at the batch
    size it was built for, so its model runs only Keras's own batches.
    Anything but a Keras layer or model has none.
    """
    if not isinstance(model, keras.layers.Layer):
        return ()
    return tuple(
        layer.name for layer in _keras_compat.all_layers(model)
        if getattr(layer, "stateful", False) is True
    )


def has_default_train_step(model: keras.Model) -> bool:
    """Whether `model` uses Keras's own `train_step` (its backend trainer's, not overridden)."""
    return getattr(type(model).train_step, "__code__", None) is keras.Model.train_step.__code__


def train_state_variables(model: keras.Model) -> List[Any]:
    """The small state a failed train step may have updated before failing.

    Metric and loss-tracker variables, the non-trainable variables of
    trainable layers (BatchNorm moving statistics, RNG seed states) and the
    optimizer's scalar variables (iterations, loss-scale counters). Trainable
    weights and optimizer slots are not included: the train steps
    keras_memfit compiles update them only after every gradient exists, so a
    step that fails has not touched them.

    Args:
        model: A built, compiled Keras model.

    Returns:
        The variables to snapshot before a train step, each once.
    """
    frozen = set()
    for layer in _keras_compat.all_layers(model):
        if not layer.trainable:
            frozen.update(id(v) for v in layer.weights)
    chosen, seen = [], set()

    def add(v):
        if id(v) not in seen:
            seen.add(id(v))
            chosen.append(v)

    for v in model.metrics_variables:
        add(v)
    for v in model.non_trainable_variables:
        if id(v) not in frozen:
            add(v)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and optimizer.built:
        for v in optimizer.variables:
            if int(np.prod(v.shape)) <= 1:
                add(v)
    return chosen


def slot_variables(optimizer: Any, variable: Any) -> List[Any]:
    """The optimizer variables created from `variable` (Adam's m and v, ...).

    Args:
        optimizer: A Keras optimizer, built or not (None gives none).
        variable: One of the model's weights.

    Returns:
        The built optimizer's variables named after `variable` with its shape.
    """
    if optimizer is None or not getattr(optimizer, "built", False):
        return []
    prefix = variable.path.replace("/", "_") + "_"
    shape = tuple(variable.shape)
    return [
        v for v in optimizer.variables
        if v.name.startswith(prefix) and tuple(v.shape) == shape
    ]
