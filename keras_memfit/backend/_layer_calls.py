"""Recording every layer and operation call of one symbolic forward pass (backends' `tracing`)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import keras

from keras_memfit._internal import keras_compat as _keras_compat
from keras_memfit.backend.base import Trace, TracedCall, TracedTensor

# (key, shape, dtype name) of one symbolic tensor.
Info = Tuple[str, Tuple[Optional[int], ...], str]

# Batch sizes of traces with concrete shapes (JAX, torch): differing dimensions follow the batch.
BATCHES = (7, 11)


class CallRecorder:
    """The calls of one forward pass (`records`: `op`, `depth`, `parent`, `inputs`, `outputs`)."""

    def __init__(self, describe: Callable[[Any], Optional[Info]]) -> None:
        self._describe = describe
        self.records: List[Dict[str, Any]] = []
        self.inputs: List[Info] = []
        self.outputs: List[str] = []
        self._stack: List[int] = []

    def infos(self, values: Any) -> List[Info]:
        """The `Info` of every symbolic tensor in the structure `values`."""
        return [i for i in map(self._describe, keras.tree.flatten(values)) if i is not None]

    def _record(self, op: Any, original: Callable, args: tuple, kwargs: dict) -> Any:
        index = len(self.records)
        entry = {"op": op, "depth": len(self._stack),
                 "parent": self._stack[-1] if self._stack else None,
                 "inputs": self.infos((args, kwargs)), "outputs": []}
        self.records.append(entry)
        self._stack.append(index)
        try:
            outputs = original(op, *args, **kwargs)
        finally:
            self._stack.pop()
        entry["outputs"] = self.infos(outputs)
        return outputs

    @contextlib.contextmanager
    def patched(self) -> Iterator["CallRecorder"]:
        """Record every layer and operation call made in the block."""
        Layer, Operation = _keras_compat.layer_and_operation_classes()
        layer_call, op_call = Layer.__call__, Operation.__call__
        record = self._record

        def patched_layer_call(layer, *args, **kwargs):
            return record(layer, layer_call, args, kwargs)

        def patched_op_call(op, *args, **kwargs):
            if isinstance(op, Layer):  # already recorded by Layer.__call__
                return op_call(op, *args, **kwargs)
            return record(op, op_call, args, kwargs)

        Layer.__call__, Operation.__call__ = patched_layer_call, patched_op_call
        try:
            yield self
        finally:
            Layer.__call__, Operation.__call__ = layer_call, op_call

    def forward(self, model: keras.Model, inputs: Any, positional: bool) -> Any:
        """Call `model` on symbolic `inputs` (no variable changes), recording inputs and outputs."""
        self.inputs = self.infos(inputs)
        with keras.StatelessScope():
            outputs = model(inputs, training=False) if positional else model(
                **inputs, training=False)
        self.outputs = [info[0] for info in self.infos(outputs)]
        return outputs


def _merge(a: List[Info], b: List[Info]) -> Tuple[TracedTensor, ...]:
    """`a`'s tensors, with None for the dimensions that differ in `b` (the batch's)."""
    out = []
    for (key, shape, dtype), (_, other_shape, _) in zip(a, b):
        if len(other_shape) != len(shape):
            other_shape = (None,) * len(shape)
        out.append(TracedTensor(
            key, tuple(None if d != e else d for d, e in zip(shape, other_shape)), dtype
        ))
    return tuple(out)


def _same_call(a: Any, b: Any) -> bool:
    """Whether two traced calls are one layer, or operations of one type (`keras.ops` are new)."""
    if a is b:
        return True
    return not isinstance(a, keras.layers.Layer) and type(a) is type(b)


def trace_at_two_batches(model: keras.Model, record: Callable[[int], CallRecorder]) -> Trace:
    """The `Trace` of `model` from two recorded passes (`record(batch)`), at `BATCHES`.

    Raises:
        ValueError: If the two passes make different calls.
    """
    first, second = (record(n) for n in BATCHES)
    records, others = first.records, second.records
    if len(records) != len(others) or any(
        not _same_call(a["op"], b["op"]) for a, b in zip(records, others)
    ):
        raise ValueError(
            f"the forward pass of model {model.name!r} calls different layers at batch "
            f"sizes {BATCHES[0]} and {BATCHES[1]} (received {len(records)} and "
            f"{len(others)} calls); memory_report needs one call graph for every batch size"
        )
    return trace_of(first, second)


def trace_of(first: CallRecorder, second: Optional[CallRecorder] = None) -> Trace:
    """The calls below the model's own (depth 0), one level up; None where `second` differs."""
    second = first if second is None else second
    calls: List[TracedCall] = []
    remap: Dict[int, int] = {}
    for index, (entry, other) in enumerate(zip(first.records, second.records)):
        if entry["depth"] == 0:
            continue
        remap[index] = len(calls)
        calls.append(TracedCall(
            entry["op"], remap.get(entry["parent"]),
            _merge(entry["inputs"], other["inputs"]), _merge(entry["outputs"], other["outputs"]),
        ))
    return Trace(_merge(first.inputs, second.inputs), tuple(first.outputs), tuple(calls))
