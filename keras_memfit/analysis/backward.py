"""One layer's own backward pass: what it needs at once, whatever else is recomputed."""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import keras

from keras_memfit._internal import keras_compat as _keras_compat
from keras_memfit.analysis.graph import LayerGraph


class LayerNeed(NamedTuple):
    """Bytes per sample a layer call's backward pass needs at once; `columns`: its column matrix."""

    layer: Any
    total: int
    columns: int


def heaviest(graph: LayerGraph, columns: bool) -> Optional[LayerNeed]:
    """The leaf layer call whose backward pass needs the most, or None."""
    classes = _keras_compat.convolution_layer_classes()
    convolutions = (classes["conv"], classes["depthwise_conv"], classes["separable_conv"])
    found = None
    for index, call in enumerate(graph.calls):
        inner = graph.children.get(index, [])
        if not isinstance(call.op, keras.layers.Layer) or any(
                isinstance(graph.calls[child].op, keras.layers.Layer) for child in inner):
            continue
        own = sum(graph.sizes[t.key] for t in call.inputs + call.outputs)
        matrix = 0
        if columns and isinstance(call.op, convolutions) and call.inputs and call.outputs:
            matrix = _columns(call.op, graph.shapes[call.inputs[0].key],
                              graph.sizes[call.outputs[0].key], graph.shapes[call.outputs[0].key])
        need = LayerNeed(call.op, 2 * own + matrix, matrix)
        if found is None or need.total > found.total:
            found = need
    return found


def _columns(layer: Any, input_shape: tuple, output_bytes: int, output_shape: tuple) -> int:
    """Kernel size x input channels x output positions, at the output's bytes per value."""
    axis = 1 if getattr(layer, "data_format", "channels_last") == "channels_first" else -1
    channels_in, channels_out = input_shape[axis], output_shape[axis]
    if not channels_in or not channels_out:
        return 0
    return math.prod(layer.kernel_size) * output_bytes * channels_in // channels_out
