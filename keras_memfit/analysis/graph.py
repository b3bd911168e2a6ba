"""The traced layer graph of a model (one symbolic forward pass): its calls, cuts and crossings."""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

import keras

from keras_memfit.backend.base import Trace


class LayerGraph:
    """The calls of one traced forward pass in order, with tensor sizes per sample by key.

    `top`: the model's own calls; `children`: call indices by parent (None: the model).
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
        """Keys of the tensors a call and its sublayers take from other calls (no repeats)."""
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
        """Bytes per sample alive after each call of `sequence`: produced by then, consumed later.

        `entering` (default: the model's inputs) count as produced before the first call.
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

    def working(self, index: int) -> int:
        """Bytes per sample a call holds at its busiest, beyond the tensors it was given."""
        inner = self.children.get(index, [])
        own = sum(self.sizes[t.key] for t in self.calls[index].outputs)
        cuts = self.cuts(inner, entering=[t.key for t in self.calls[index].inputs])
        live, previous = 0, 0
        for position, child in enumerate(inner):
            live = max(live, previous + self.working(child))
            previous = cuts[position]
        return max(live, own)

    def crossing(self, layers: Iterable[Any]) -> int:
        """Bytes per sample crossing between the top-level `layers` and the rest, each tensor once.

        A pinned call's output is a new tensor: a pinned layer returning its input sends it back.
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
                for t in call.outputs:
                    current[t.key] = f"{t.key}@{position}"
                    sizes[current[t.key]] = sizes[t.key]
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
