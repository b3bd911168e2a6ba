"""Symbolic traces of a model's layer calls on JAX: `jax.eval_shape` at two batch sizes."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import jax
import keras
import numpy as np

from keras_memfit._internal import keras_compat as _keras_compat
from keras_memfit.backend._layer_calls import CallRecorder, Info, trace_at_two_batches
from keras_memfit.backend.base import Trace


def _record_forward(model: keras.Model, batch: int) -> CallRecorder:
    struct, positional = _keras_compat.input_structure(model)
    specs = keras.tree.map_structure(
        lambda t: jax.ShapeDtypeStruct((batch,) + tuple(t.shape[1:]), np.dtype(t.dtype)),
        struct,
    )
    keys: Dict[int, str] = {}
    alive: List[Any] = []  # the traced arrays, kept so that their ids stay unique

    def describe(value: Any) -> Optional[Info]:
        if not isinstance(value, (jax.Array, jax.core.Tracer)):
            return None
        key = keys.get(id(value))
        if key is None:
            key = keys[id(value)] = f"t{len(keys)}"
            alive.append(value)
        return key, tuple(int(d) for d in value.shape), np.dtype(value.dtype).name

    recorder = CallRecorder(describe)
    with recorder.patched():
        jax.eval_shape(lambda inputs: recorder.forward(model, inputs, positional), specs)
    return recorder


def trace_layer_calls(model: keras.Model) -> Trace:
    return trace_at_two_batches(model, lambda batch: _record_forward(model, batch))
