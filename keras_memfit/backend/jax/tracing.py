"""Symbolic traces of a model on JAX: every layer and operation call of one forward pass.

The JAX counterpart of the TensorFlow backend's `tracing` (`memory_report`'s
input): the model is called inside `jax.eval_shape` (nothing runs, nothing
is allocated) and a `keras.StatelessScope`, with `Layer.__call__` and
`Operation.__call__` wrapped to record each call. JAX traces static shapes,
so the forward pass is traced at two batch sizes and a dimension that
differs between them is the batch's (None), as `steps.output_spec` does.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import jax
import keras
import numpy as np

from keras_memfit._internal import keras_compat as _keras_compat
from keras_memfit.backend._layer_calls import CallRecorder, Info, traced_calls
from keras_memfit.backend.base import Trace, TracedTensor

# Two batch sizes unlikely to equal a model's other dimensions.
_BATCHES = (7, 11)

def _record_forward(model: keras.Model, batch: int) -> CallRecorder:
    """One traced forward pass at `batch` rows: the calls, inputs and outputs."""
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


def _merge(a: List[Info], b: List[Info]) -> Tuple[TracedTensor, ...]:
    """`a`'s tensors, with None for the dimensions that differ in `b` (the batch's)."""
    out = []
    for (key, shape, dtype), other in zip(a, b):
        other_shape = other[1]
        if len(other_shape) != len(shape):
            other_shape = (None,) * len(shape)
        out.append(TracedTensor(
            key, tuple(None if d != e else d for d, e in zip(shape, other_shape)), dtype
        ))
    return tuple(out)


def _same_call(a: Any, b: Any) -> bool:
    """Whether two traced calls are the same call: one layer, or an operation of one type.

    Functional ops (`keras.ops.*` inside a layer's `call`, as EfficientNet's
    layers make) build a new `Operation` object at every call.
    """
    if a is b:
        return True
    return not isinstance(a, keras.layers.Layer) and type(a) is type(b)


def trace_layer_calls(model: keras.Model) -> Trace:
    """Every layer and operation call of one symbolic forward pass of `model`.

    Args:
        model: A built Keras model.

    Returns:
        The `Trace`: the model's input tensors, its output keys and every
        call below the model's own, in call order (`parent` None for the
        model's direct children). Shapes have None for the batch dimension
        (and any other dimension that follows the batch size).

    Raises:
        ValueError: If the model has not been built, or its forward pass
            makes different calls at two batch sizes.

    Example:
        >>> trace = trace_layer_calls(model)
        >>> [type(call.op).__name__ for call in trace.calls][:2]
        ['Conv2D', 'Conv2D']
    """
    first, second = (_record_forward(model, n) for n in _BATCHES)
    records, others = first.records, second.records
    if len(records) != len(others) or any(
        not _same_call(a["op"], b["op"]) for a, b in zip(records, others)
    ):
        raise ValueError(
            f"the forward pass of model {model.name!r} calls different layers at batch "
            f"sizes {_BATCHES[0]} and {_BATCHES[1]} (received {len(records)} and "
            f"{len(others)} calls); memory_report needs one call graph for every batch size"
        )

    def tensors(index: int, which: str) -> Tuple[TracedTensor, ...]:
        return _merge(records[index][which], others[index][which])

    return Trace(_merge(first.inputs, second.inputs), tuple(first.outputs),
                 traced_calls(records, tensors))
