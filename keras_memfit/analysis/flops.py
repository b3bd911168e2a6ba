"""Forward FLOPs per sample of traced calls (a multiply-add counts 2; bias and activation 0)."""

from __future__ import annotations

from typing import Optional

import keras

from keras_memfit._internal import keras_compat as _keras_compat
from keras_memfit.analysis.graph import LayerGraph
from keras_memfit.analysis.sizes import size
from keras_memfit.backend.base import TracedCall

_ZERO_FLOP_LAYERS = (
    "InputLayer", "Flatten", "Reshape", "Permute", "RepeatVector", "Dropout",
    "SpatialDropout1D", "SpatialDropout2D", "SpatialDropout3D", "GaussianDropout",
    "GaussianNoise", "AlphaDropout", "Concatenate", "Identity", "Embedding",
    "ZeroPadding1D", "ZeroPadding2D", "ZeroPadding3D", "Cropping1D", "Cropping2D",
    "Cropping3D", "ActivityRegularization", "Masking",
)
_MERGE_LAYERS = ("Add", "Subtract", "Multiply", "Average", "Maximum", "Minimum")
_ELEMENTWISE_LAYERS = ("Activation", "ReLU", "LeakyReLU", "ELU", "PReLU", "Softmax")
_NORMALIZATION_LAYERS = ("BatchNormalization", "LayerNormalization", "GroupNormalization",
                         "RMSNormalization", "UnitNormalization")


def flops_per_sample(graph: LayerGraph, index: int) -> Optional[int]:
    """Forward FLOPs per sample of call `index` (else its sublayers'), or None where unknown."""
    own = layer_flops(graph.calls[index])
    if own is not None:
        return own
    inner = graph.children.get(index, [])
    if not inner:
        return None
    parts = [flops_per_sample(graph, child) for child in inner]
    return None if any(p is None for p in parts) else sum(parts) + _attention_flops(
        graph.calls[index])


def _attention_flops(call: TracedCall) -> int:
    """A MultiHeadAttention's scores and weighted sum (per sample); 0 for other layers."""
    layer = call.op
    if not isinstance(layer, keras.layers.MultiHeadAttention):
        return 0
    queries = call.outputs[0].shape[1:-1]
    keys = call.inputs[-1].shape[1:-1] if call.inputs else queries
    if None in queries or None in keys:
        return 0
    value_dim = layer.value_dim or layer.key_dim
    return 2 * layer.num_heads * size(queries) * size(keys) * (layer.key_dim + value_dim)


def layer_flops(call: TracedCall) -> Optional[int]:
    """Forward FLOPs per sample of one call of a layer of a known kind, or None."""
    bases = _keras_compat.convolution_layer_classes()
    layer = call.op
    outputs = [t.shape[1:] for t in call.outputs]
    if not outputs or any(None in shape for shape in outputs):
        return None
    out = outputs[0]
    out_size = size(out)
    name = type(layer).__name__
    if name in _ZERO_FLOP_LAYERS or isinstance(layer, keras.layers.Embedding):
        return 0  # an Embedding subclass's own extra work (a combiner) is not counted
    kernel = getattr(layer, "kernel", None)
    channels_first = getattr(layer, "data_format", None) == "channels_first"
    spatial = (out[1:] if channels_first else out[:-1]) if len(out) > 1 else ()
    if isinstance(layer, keras.layers.Dense):
        if kernel is None:
            return None
        return 2 * size(kernel.shape) * size(out[:-1])  # kernel: (fan_in, units)
    if isinstance(layer, bases["depthwise_conv"]):
        return 2 * size(layer.kernel_size) * out_size
    if isinstance(layer, bases["separable_conv"]):
        depthwise = layer.depthwise_kernel
        in_channels = int(depthwise.shape[-2]) * int(depthwise.shape[-1])
        return 2 * size(spatial) * in_channels * (size(layer.kernel_size) + layer.filters)
    if isinstance(layer, bases["conv_transpose"]):
        if kernel is None:
            return None
        # kernel: (*kernel_size, filters, in_channels); each input feeds kernel_size x filters.
        in_channels, filters = int(kernel.shape[-1]), int(kernel.shape[-2])
        stride = size(layer.strides)
        in_positions = size(spatial) // max(1, stride)
        return 2 * size(layer.kernel_size) * in_channels * filters * in_positions
    if isinstance(layer, bases["conv"]):
        if kernel is None:
            return None
        # kernel: (*kernel_size, in_channels / groups, filters)
        per_output = size(layer.kernel_size) * int(kernel.shape[-2])
        return 2 * per_output * out_size
    if isinstance(layer, bases["global_pooling"]):
        shape = call.inputs[0].shape if call.inputs else None
        return None if shape is None or None in shape[1:] else size(shape[1:])
    if isinstance(layer, bases["pooling"]):
        return size(layer.pool_size) * out_size
    if name in _MERGE_LAYERS:
        return max(0, len(call.inputs) - 1) * out_size
    if name in _ELEMENTWISE_LAYERS:
        return out_size
    if name in _NORMALIZATION_LAYERS:
        return 2 * out_size
    if isinstance(layer, keras.layers.EinsumDense) and kernel is not None:
        # Each output element sums over the kernel's dimensions the output lacks.
        kernel_labels = layer.equation.split(",")[1].split("->")[0]
        output_labels = layer.equation.split("->")[1]
        summed = [int(n) for label, n in zip(kernel_labels, kernel.shape)
                  if label not in output_labels]
        return 2 * size(summed) * sum(size(shape) for shape in outputs)
    return None
