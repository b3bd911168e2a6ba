"""What a compiled Keras model holds, read through Keras's public API alone."""

from __future__ import annotations

from typing import Any, List, Tuple

import keras
import numpy as np

from keras_memfit._internal import keras_compat as _keras_compat


def stateful_layers(model: keras.Model) -> Tuple[str, ...]:
    """The names of `model`'s layers built with `stateful=True`; () for a non-Keras object."""
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
    """Metric, optimizer-scalar and trainable layers' non-trainable variables, to snapshot.

    Not weights or slots: keras_memfit's steps update them only after every gradient exists.
    """
    frozen = set()
    for layer in _keras_compat.all_layers(model):
        if not layer.trainable:
            frozen.update(id(v) for v in layer.weights)
    chosen = list(model.metrics_variables)
    chosen += [v for v in model.non_trainable_variables if id(v) not in frozen]
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and optimizer.built:
        chosen += [v for v in optimizer.variables if int(np.prod(v.shape)) <= 1]
    return list({id(v): v for v in chosen}.values())  # each once, in that order


def slot_variables(optimizer: Any, variable: Any) -> List[Any]:
    """The built optimizer's variables made from `variable` (Adam's m and v...); [] if unbuilt."""
    if optimizer is None or not getattr(optimizer, "built", False):
        return []
    prefix = variable.path.replace("/", "_") + "_"
    shape = tuple(variable.shape)
    return [
        v for v in optimizer.variables
        if v.name.startswith(prefix) and tuple(v.shape) == shape
    ]
