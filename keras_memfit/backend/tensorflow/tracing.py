"""Symbolic traces of a model: every layer and operation call of one forward pass."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import keras
import tensorflow as tf

from keras_memfit._internal import keras_compat as _keras_compat
from keras_memfit.backend._layer_calls import CallRecorder, trace_of
from keras_memfit.backend.base import Trace


def _tensor_info(value: Any) -> Optional[Tuple[str, Tuple[Optional[int], ...], str]]:
    if not isinstance(value, tf.Tensor) or not hasattr(value, "graph"):
        return None
    shape = tuple(value.shape.as_list()) if value.shape.rank is not None else (None,)
    return value.name, shape, value.dtype.name


def trace_layer_calls(model: keras.Model) -> Trace:
    """Traced in a throw-away `tf.function` within a `keras.StatelessScope`."""
    struct, positional = _keras_compat.input_structure(model)
    spec = keras.tree.map_structure(  # the batch dimension unknown
        lambda t: tf.TensorSpec((None,) + tuple(t.shape[1:]), tf.as_dtype(t.dtype)), struct
    )
    flat_spec = keras.tree.flatten(spec)
    recorder = CallRecorder(_tensor_info)

    def forward(*flat):
        return recorder.forward(model, keras.tree.pack_sequence_as(spec, flat), positional)

    with recorder.patched():
        tf.function(forward, autograph=False).get_concrete_function(*flat_spec)
    return trace_of(recorder)
