"""Symbolic traces of a model: its input structure and every layer call."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import keras
import tensorflow as tf

from keras_memfit import _keras_compat


def probe_inputs(model: keras.Model) -> Tuple[Any, bool]:
    """Zeros, one sample, in the structure `model` is called with: (inputs, positional).

    The structure is the one `trace_layer_calls` uses (a functional or
    Sequential model's `Input`s, a dict or list of them included; a
    subclassed model's build shapes, dicts and lists included). Unknown
    dimensions are 1. Call `model(inputs)` when `positional`, else
    `model(**inputs)`.

    Raises:
        ValueError: If the model has not been built.
    """
    spec, positional = _model_input_specs(model)

    def zeros(s):
        shape = (1,) + tuple(1 if d is None else int(d) for d in s.shape[1:])
        return tf.zeros(shape, dtype=s.dtype)

    return keras.tree.map_structure(zeros, spec), positional


def _model_input_specs(model: keras.Model) -> Tuple[Any, bool]:
    """(structure of `tf.TensorSpec`s, positional) to call `model` symbolically with.

    The structure is Keras's (see `_keras_compat.input_structure`); the batch
    dimension is always unknown.

    Raises:
        ValueError: If the model has not been built.
    """
    struct, positional = _keras_compat.input_structure(model)
    spec = keras.tree.map_structure(
        lambda t: tf.TensorSpec((None,) + tuple(t.shape[1:]), tf.as_dtype(t.dtype)), struct
    )
    return spec, positional


def _tensor_info(value: Any) -> Optional[Tuple[str, Tuple[Optional[int], ...], str]]:
    if not isinstance(value, tf.Tensor) or not hasattr(value, "graph"):
        return None
    shape = tuple(value.shape.as_list()) if value.shape.rank is not None else (None,)
    return value.name, shape, value.dtype.name


def trace_layer_calls(model: keras.Model) -> dict:
    """Every layer and operation call of one symbolic forward pass of `model`.

    Calls `model(inputs, training=False)` inside a throw-away `tf.function`
    trace (nothing runs, nothing is allocated) and a `keras.StatelessScope`
    (no variable changes, no losses recorded), with `Layer.__call__` and
    `Operation.__call__` temporarily wrapped to record each call; both are
    restored before returning.

    Args:
        model: A built Keras model.

    Returns:
        A dict with `inputs` (list of tensor infos: `(key, shape, dtype)` where
        `key` identifies the tensor and `shape` includes the batch dimension
        as None), `outputs` (keys of the model's outputs) and `calls`: one dict
        per call in call order with `op` (the layer or operation), `depth`
        (1 for the model's direct children), `parent` (index of the enclosing
        call, None at depth 1), `inputs` and `outputs` (tensor infos).

    Raises:
        ValueError: If the model has not been built.
    """
    Layer, Operation = _keras_compat.layer_and_operation_classes()

    spec, positional = _model_input_specs(model)
    flat_spec = keras.tree.flatten(spec)
    records: list = []
    stack: list = []
    result: dict = {}
    layer_call, op_call = Layer.__call__, Operation.__call__

    def record(op, original, args, kwargs):
        index = len(records)
        entry = {
            "op": op,
            "depth": len(stack),
            "parent": stack[-1] if stack else None,
            "inputs": [
                info for info in map(_tensor_info, keras.tree.flatten((args, kwargs)))
                if info is not None
            ],
            "outputs": [],
        }
        records.append(entry)
        stack.append(index)
        try:
            outputs = original(op, *args, **kwargs)
        finally:
            stack.pop()
        infos = [_tensor_info(t) for t in keras.tree.flatten(outputs)]
        entry["outputs"] = [info for info in infos if info is not None]
        return outputs

    def patched_layer_call(self, *args, **kwargs):
        return record(self, layer_call, args, kwargs)

    def patched_op_call(self, *args, **kwargs):
        if isinstance(self, Layer):  # already recorded by Layer.__call__
            return op_call(self, *args, **kwargs)
        return record(self, op_call, args, kwargs)

    def forward(*flat):
        inputs = keras.tree.pack_sequence_as(spec, flat)
        result["inputs"] = [_tensor_info(t) for t in flat]
        with keras.StatelessScope():
            if positional:
                outputs = model(inputs, training=False)
            else:
                outputs = model(**inputs, training=False)
        result["outputs"] = [
            info[0] for info in map(_tensor_info, keras.tree.flatten(outputs)) if info
        ]
        return outputs

    Layer.__call__, Operation.__call__ = patched_layer_call, patched_op_call
    try:
        tf.function(forward, autograph=False).get_concrete_function(*flat_spec)
    finally:
        Layer.__call__, Operation.__call__ = layer_call, op_call
    # The model's own call is depth 0: keep its descendants, one level up.
    calls = []
    remap = {}
    for index, entry in enumerate(records):
        if entry["depth"] == 0:
            continue
        remap[index] = len(calls)
        entry = dict(entry)
        entry["parent"] = remap.get(entry["parent"])
        calls.append(entry)
    result["calls"] = calls
    return result
