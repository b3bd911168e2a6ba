"""MemFit's rung after splitting: recomputing layers in the backward pass (rematerialization).

Splitting a batch helps until a piece is one sample. When one sample runs
out of memory in training, MemFit recomputes some of the model's top-level
blocks in the backward pass instead of keeping what they produce inside
(the backend's `checkpoint`: `tf.recompute_grad`, `jax.checkpoint`, torch's
non-reentrant `checkpoint`), and runs the batch again. The blocks come from
the model's analysis (`keras_memfit.analysis`, what `memory_report` shows):
each top-level call whose tensors inside outweigh what it leaves alive
after it, the largest saving first. Each OOM at one sample doubles how many
are recomputed (1, 2, 4, ... all); the number is remembered per model and
input signature, so a later `fit` starts there.

The update stays the one plain Keras makes. A recomputed call passes the
layer's non-trainable state (seed generator states, BatchNormalization's
moving statistics) in as inputs, assigns it first and returns its final
values: the recomputation draws the forward pass's random values and ends on
the forward pass's state, which is assigned once, outside.

Example:
    >>> remat = Rematerialization(model, "auto")
    >>> remat.apply(signature)        # the signature's layers, wrapped
    ()
    >>> remat.escalate(signature)     # after an OOM at one sample
    True
    >>> remat.release()               # at the end of fit: the model as it was
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple, Union

import keras

from keras_memfit import backend as _backend
from keras_memfit.analysis import analyse

logger = logging.getLogger("keras_memfit")

Setting = Union[str, bool, Sequence[str]]

# Per model: how many blocks each input signature recomputes, and the blocks.
_COUNTS: "weakref.WeakKeyDictionary[Any, Dict[Hashable, int]]" = weakref.WeakKeyDictionary()
_BLOCKS: "weakref.WeakKeyDictionary[Any, Tuple[List[Block], int]]" = weakref.WeakKeyDictionary()


@dataclasses.dataclass(frozen=True)
class Block:
    """A top-level layer MemFit may recompute.

    Attributes:
        layer: The layer.
        saving: Bytes per sample it holds inside beyond what is alive after
            it (what recomputing it frees, estimated).
        flops: Its forward FLOPs per sample, or None where unknown.
    """

    layer: Any
    saving: int
    flops: Optional[int]


def blocks(model: keras.Model) -> Tuple[List[Block], int]:
    """The layers of `model` worth recomputing, the largest saving first, and
    the model's forward FLOPs per sample (0 where unknown).

    Raises:
        ValueError: If the model has not been built.
    """
    analysis = analyse(model)
    found: Dict[int, Block] = {}
    for row in analysis.rows:
        layer = row.op
        if isinstance(layer, keras.layers.Layer) and id(layer) not in found and row.inside:
            found[id(layer)] = Block(layer, row.inside, row.flops)
    total = sum(row.flops or 0 for row in analysis.rows)
    return sorted(found.values(), key=lambda block: -block.saving), total


def check_setting(remat: Any) -> None:
    """Raise `ValueError` unless `remat` is "auto", False or a list of layer names."""
    if remat == "auto" or remat is False:
        return
    if isinstance(remat, (list, tuple)) and remat and all(isinstance(n, str) for n in remat):
        return
    raise ValueError(
        f'remat must be "auto", False or a list of layer names; received remat={remat!r}'
    )


class Rematerialization:
    """Which layers of one model MemFit recomputes, per input signature, and their wrapping.

    Args:
        model: The model being trained.
        setting: "auto" (recompute where one sample does not fit), False
            (never) or the names of the layers to recompute from the start.

    Raises:
        ValueError: If a name in `setting` is not a layer of `model`.
    """

    def __init__(self, model: keras.Model, setting: Setting) -> None:
        self.model = model
        self.setting = setting
        self._blocks: Optional[List[Block]] = None
        self._total_flops = 0
        # Per input signature, how many blocks are recomputed (remembered per model).
        self._counts: Dict[Hashable, int] = (
            _COUNTS.setdefault(model, {}) if setting == "auto" else {})
        self._forced: Optional[List[Any]] = None
        if isinstance(setting, (list, tuple)):
            names = {layer.name: layer for layer in model.layers}
            missing = [name for name in setting if name not in names]
            if missing:
                raise ValueError(
                    f"remat names layers that model '{model.name}' does not have at its top "
                    f"level: {missing}; its layers are {sorted(names)}. Received remat={setting!r}"
                )
            self._forced = [names[name] for name in setting]
        self._wrapped: Dict[int, Tuple[Any, Callable]] = {}  # id(layer) -> (layer, its call)

    def _chosen(self, signature: Hashable) -> List[Any]:
        if self._forced is not None:
            return self._forced
        count = self._counts.get(signature, 0)
        if not count:
            return []
        return [block.layer for block in self._candidates()[:count]]

    def _candidates(self) -> List[Block]:
        """The blocks, found at the first need (once per model)."""
        if self._blocks is None:
            if self.model not in _BLOCKS:
                _BLOCKS[self.model] = _blocks_or_none(self.model)
            self._blocks, self._total_flops = _BLOCKS[self.model]
        return self._blocks

    def names(self, signature: Hashable) -> Tuple[str, ...]:
        """The names of the layers recomputed for batches of `signature`."""
        return tuple(layer.name for layer in self._chosen(signature))

    def apply(self, signature: Hashable) -> Tuple[str, ...]:
        """Wrap exactly the layers recomputed for `signature`; returns their names."""
        chosen = self._chosen(signature)
        keep = {id(layer) for layer in chosen}
        for key in [key for key in self._wrapped if key not in keep]:
            layer, _ = self._wrapped.pop(key)
            del layer.call
        for layer in chosen:
            if id(layer) not in self._wrapped:
                self._wrapped[id(layer)] = (layer, _wrap(layer))
        return tuple(layer.name for layer in chosen)

    def escalate(self, signature: Hashable) -> bool:
        """Recompute more layers for `signature` after one sample ran out of memory.

        Returns:
            False when there is nothing more to recompute (`setting` False or
            a list, or every block already is).
        """
        if self.setting != "auto":
            return False
        candidates = self._candidates()
        count = self._counts.get(signature, 0)
        if count >= len(candidates):
            return False
        self._counts[signature] = min(len(candidates), max(1, 2 * count))
        return True

    def step_time(self, signature: Hashable) -> Optional[float]:
        """The estimated step time over that without recomputation, or None.

        A train step costs about three forward passes; the recomputation
        adds the recomputed layers' forward FLOPs once more.
        """
        if self._forced is not None or not self._total_flops:
            return None
        flops = [block.flops for block in self._candidates()[:self._counts.get(signature, 0)]]
        if None in flops:
            return None
        return round(1 + sum(flops) / (3 * self._total_flops), 2)

    def saving(self, signature: Hashable) -> int:
        """Bytes per sample the recomputed layers free, estimated (0 if unknown)."""
        if self._forced is not None:
            return 0
        return sum(block.saving for block in self._candidates()[:self._counts.get(signature, 0)])

    def release(self) -> None:
        """Unwrap every layer: the model's calls as they were."""
        for layer, _ in self._wrapped.values():
            del layer.call
        self._wrapped.clear()


def _blocks_or_none(model: keras.Model) -> Tuple[List[Block], int]:
    _backend.get().materialize(model)  # inside Keras's JAX loop: the variables, readable
    try:
        return blocks(model)
    except Exception as err:  # noqa: BLE001 - nothing to recompute: MemFit raises as before
        logger.debug("no blocks to recompute in %s: %s", getattr(model, "name", model), err)
        return [], 0


def _wrap(layer: Any) -> Callable:
    """Make `layer`'s call recompute in the backward pass, exactly; returns the original call.

    The call's tensor arguments become the recomputed function's inputs,
    with the values of the layer's non-trainable variables; everything else
    (`training=`, masks given as None, Python values) is closed over. A
    symbolic call (Keras tensors) runs as it is.
    """
    original = layer.call
    checkpoint = _backend.get().checkpoint
    state = list(layer.non_trainable_variables)

    def call(*args: Any, **kwargs: Any) -> Any:
        leaves = keras.tree.flatten((args, kwargs))
        if any(isinstance(leaf, keras.KerasTensor) for leaf in leaves):
            return original(*args, **kwargs)
        is_tensor = [keras.ops.is_tensor(leaf) for leaf in leaves]
        tensors = [leaf for leaf, tensor in zip(leaves, is_tensor) if tensor]
        n = len(tensors)

        def recomputed(*values: Any) -> Any:
            for variable, value in zip(state, values[n:]):
                variable.assign(value)
            inputs = iter(values[:n])
            rebuilt = [next(inputs) if tensor else leaf for leaf, tensor in zip(leaves, is_tensor)]
            args_, kwargs_ = keras.tree.pack_sequence_as((args, kwargs), rebuilt)
            return original(*args_, **kwargs_), [variable.value for variable in state]

        # Copies: torch assigns in place, and the recomputation must read the start.
        start = [keras.ops.copy(variable.value) for variable in state]
        outputs, final = checkpoint(recomputed)(*tensors, *start)
        for variable, value in zip(state, final):
            variable.assign(value)
        return outputs

    layer.call = call
    return original
