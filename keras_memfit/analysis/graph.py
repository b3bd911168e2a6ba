"""The traced layer graph of a model: its calls, its cuts, the bytes crossing them.

One symbolic forward pass (`keras_memfit.backend.get().trace_layer_calls`)
records every layer and operation call with the tensors it takes and makes.
`LayerGraph` turns that record into the questions the analysis asks: which
tensors a call produces and consumes, the bytes per sample alive after each
call of a sequence (a cut), the busiest live set inside a call, and the bytes
per sample crossing between any set of top-level layers and the rest.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

import keras

from keras_memfit.backend.base import Trace, TracedCall, TracedTensor


Tensor = TracedTensor
Call = TracedCall


class LayerGraph:
    """The calls of one traced forward pass, with tensor sizes per sample.

    Args:
        trace: What `keras_memfit.backend.get().trace_layer_calls(model)` returned.
        tensor_bytes: Bytes per sample of a tensor, from its shape (batch
            dimension first) and dtype.

    Attributes:
        inputs: The model's input tensors.
        outputs: Keys of the model's output tensors.
        calls: Every call, in call order.
        top: Indices of the model's own calls (its top-level layers and ops).
        sizes: Bytes per sample of every tensor, by key.
        shapes: Shape of every tensor, by key.
    """

    def __init__(self, trace: Trace, tensor_bytes: Callable[[Sequence[Optional[int]], Any], int]):
        self.inputs, self.outputs, self.calls = list(trace.inputs), list(trace.outputs), list(trace.calls)
        self.sizes: Dict[str, int] = {}
        self.shapes: Dict[str, tuple] = {}
        every = list(self.inputs) + [t for call in self.calls for t in call.inputs + call.outputs]
        for tensor in every:
            if tensor.key not in self.sizes:
                self.sizes[tensor.key] = tensor_bytes(tensor.shape, tensor.dtype)
                self.shapes[tensor.key] = tensor.shape
        self.children: Dict[Optional[int], List[int]] = {}
        for index, call in enumerate(self.calls):
            self.children.setdefault(call.parent, []).append(index)
        self.top: List[int] = self.children.get(None, [])
        self._all_produced = {t.key for call in self.calls for t in call.outputs}
        self._produced: Dict[int, List[str]] = {}
        self._consumed: Dict[int, List[str]] = {}

    @property
    def input_keys(self) -> List[str]:
        """Keys of the model's inputs, in order."""
        return [t.key for t in self.inputs]

    def produced(self, index: int) -> List[str]:
        """Keys of the tensors a call and all its descendants produce (no repeats)."""
        if index not in self._produced:
            keys = dict.fromkeys(t.key for t in self.calls[index].outputs)
            for child in self.children.get(index, []):
                keys.update(dict.fromkeys(self.produced(child)))
            self._produced[index] = list(keys)
        return self._produced[index]

    def consumed(self, index: int) -> List[str]:
        """Keys of the tensors a call takes from outside itself (no repeats).

        Its own arguments, plus what its sublayers take that some other call
        produced (a tensor its sublayers get from an operation inside its
        `call` that is not a layer is internal to it).
        """
        if index not in self._consumed:
            keys = dict.fromkeys(t.key for t in self.calls[index].inputs)
            inner = set(self.produced(index))
            for child in self.descendants(index):
                for t in self.calls[child].inputs:
                    if t.key in self._all_produced and t.key not in inner:
                        keys[t.key] = None
            self._consumed[index] = [key for key in keys if key not in inner]
        return self._consumed[index]

    def descendants(self, index: int) -> List[int]:
        """Indices of every call nested in call `index`, depth first."""
        found = []
        for child in self.children.get(index, []):
            found.append(child)
            found.extend(self.descendants(child))
        return found

    def cuts(
        self,
        sequence: Sequence[int],
        sizes: Optional[Dict[str, int]] = None,
        entering: Optional[Sequence[str]] = None,
    ) -> List[int]:
        """Bytes per sample alive across a cut after each call of `sequence`.

        A tensor counts at the cut after a call when it was produced at or
        before that call and is consumed after it. Tensors in `entering` (by
        default the model's inputs) are produced before the first call; a
        tensor nobody in `sequence` produced is taken as produced right before
        its first consumer.

        Args:
            sequence: Call indices, in call order (e.g. `top`).
            sizes: Bytes per sample by key; defaults to `self.sizes`.
            entering: Keys of the tensors present before the first call.

        Returns:
            The bytes per sample at the cut after each call.
        """
        sizes = self.sizes if sizes is None else sizes
        entering = self.input_keys if entering is None else entering
        produced_at: Dict[str, int] = {key: -1 for key in entering}
        last_use: Dict[str, int] = {}
        for position, index in enumerate(sequence):
            for key in self.consumed(index):
                if key not in produced_at:
                    produced_at[key] = position - 1
                last_use[key] = max(last_use.get(key, -1), position)
            for key in self.produced(index):
                produced_at.setdefault(key, position)
        return [
            sum(sizes.get(key, 0) for key, used in last_use.items()
                if used > position and produced_at[key] <= position)
            for position in range(len(sequence))
        ]

    def working(self, index: int, sizes: Optional[Dict[str, int]] = None) -> int:
        """Bytes per sample a call holds at its busiest, beyond the tensors it was given.

        A leaf call: what it produces. A call with sublayers: the largest, over
        its sublayers in order, of what crosses into that sublayer from before
        plus that sublayer's own working bytes (its inputs from outside are
        counted by the caller).
        """
        sizes = self.sizes if sizes is None else sizes
        inner = self.children.get(index, [])
        own = sum(sizes.get(t.key, 0) for t in self.calls[index].outputs)
        if not inner:
            return own
        entering = [t.key for t in self.calls[index].inputs]
        cuts = self.cuts(inner, sizes, entering)
        live, previous = 0, 0
        for position, child in enumerate(inner):
            live = max(live, previous + self.working(child, sizes))
            previous = cuts[position]
        return max(live, own)

    def crossing(self, layers: Iterable[Any]) -> int:
        """Bytes per sample crossing between the top-level `layers` and the rest.

        Counted over the model's top-level layer calls (every call of each):
        a tensor a call of `layers` takes from another top-level layer, and a
        tensor it produces that some other top-level layer, or no layer (the
        model's own operations, a returned output), consumes. The model's
        inputs and what operations that are not layers produce are not
        counted; a nested layer in `layers` adds nothing. What a call of
        `layers` returns is a new tensor, as it is once placed (its call runs
        on its own device): a pinned layer that returns its input (Dropout at
        inference) sends it back across.

        Args:
            layers: The layers on one side of the cut (the rest is the other).

        Returns:
            Bytes per sample; each tensor counted once.
        """
        pinned = {id(layer) for layer in layers}
        sizes = dict(self.sizes)
        current: Dict[str, str] = {}  # key -> the tensor it is now (a pinned call's output)
        flows = []  # (pinned, input keys, output keys) of each top-level layer call
        for position, index in enumerate(self.top):
            call = self.calls[index]
            if not isinstance(call.op, keras.layers.Layer):
                continue
            inputs = [current.get(t.key, t.key) for t in call.inputs]
            if id(call.op) in pinned:
                outputs = []
                for t in call.outputs:
                    current[t.key] = f"{t.key}@{position}"
                    sizes[current[t.key]] = sizes[t.key]
                    outputs.append(current[t.key])
            else:
                outputs = [current.get(t.key, t.key) for t in call.outputs]
            flows.append((id(call.op) in pinned, inputs, outputs))
        producer: Dict[str, bool] = {}  # key -> whether its (last) producer is pinned
        consumers: Dict[str, set] = {}  # key -> whether each consumer is pinned
        for is_pinned, inputs, outputs in flows:
            for key in inputs:
                consumers.setdefault(key, set()).add(is_pinned)
            for key in outputs:
                producer[key] = is_pinned
        seen: set = set()
        for is_pinned, inputs, outputs in flows:
            if not is_pinned:
                continue
            seen.update(key for key in inputs if producer.get(key) is False)
            seen.update(key for key in outputs if consumers.get(key, {False}) != {True})
        return sum(sizes[key] for key in seen)
