"""MemFit's rung after splitting: recomputing layers in the backward pass (rematerialization).

Splitting a batch helps until a piece is one sample. When one sample runs
out of memory in training, MemFit recomputes some of the model's top-level
blocks in the backward pass instead of keeping what they produce inside
(the backend's `checkpoint`: `tf.recompute_grad`, `jax.checkpoint`, torch's
non-reentrant `checkpoint`), and runs the batch again. The blocks come from
the model's analysis (`keras_memfit.analysis`, what `memory_report` shows):
each top-level call that holds tensors inside beyond its outputs (a
transformer layer, a residual block; in a nested functional model, such as
a KerasHub task's backbone, its own) or, in a `keras.Sequential`, runs of
about sqrt(n) consecutive layers (the outputs inside a run are what
recomputing it frees), the largest saving first. Each OOM at one sample
doubles how many are recomputed (1, 2, 4, ... all); the number is
remembered per model and input signature, so a later `fit` starts there.

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
import math
import weakref
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple, Union

import keras

from keras_memfit import backend as _backend
from keras_memfit._internal import lengths as _lengths
from keras_memfit.analysis import ModelAnalysis, analyse

logger = logging.getLogger("keras_memfit")

Setting = Union[str, bool, Sequence[str]]

# Per model: how many blocks each input signature recomputes, and the blocks.
_COUNTS: "weakref.WeakKeyDictionary[Any, Dict[Hashable, int]]" = weakref.WeakKeyDictionary()
_BLOCKS: "weakref.WeakKeyDictionary[Any, Tuple[List[Block], int]]" = weakref.WeakKeyDictionary()


@dataclasses.dataclass(frozen=True)
class Block:
    """Layers MemFit may recompute together: one top-level layer, or a run
    of consecutive layers of a `keras.Sequential`.

    Attributes:
        layers: The layers, in call order.
        saving: Bytes per sample they hold beyond what is alive after the
            last of them (what recomputing them frees, estimated).
        flops: Their forward FLOPs per sample, or None where unknown.
    """

    layers: Tuple[Any, ...]
    saving: int
    flops: Optional[int]


def blocks(model: keras.Model, analysis: Optional[ModelAnalysis] = None) -> Tuple[List[Block], int]:
    """The blocks of `model` worth recomputing, the largest saving first,
    and the model's forward FLOPs per sample (0 where unknown).

    Args:
        model: A built model.
        analysis: Its analysis, where already made (`memory_report`).

    Raises:
        ValueError: If the model has not been built.
    """
    if analysis is None:
        analysis = analyse(model)
    rows = [row for row in analysis.rows if isinstance(row.op, keras.layers.Layer)]
    total = sum(row.flops or 0 for row in analysis.rows)
    if isinstance(model, keras.Sequential):
        found = _runs(rows)
    else:
        first: Dict[int, Any] = {}
        for row in rows:
            first.setdefault(id(row.op), row)  # a shared layer: its first call
        found = []
        for row in first.values():
            # A nested functional model (a KerasHub task's backbone) recomputed
            # whole frees nothing at its backward pass's peak: its own blocks.
            nested = isinstance(row.op, keras.Model) and not isinstance(row.op, keras.Sequential)
            inner = blocks(row.op)[0] if nested else []
            if inner or row.inside:
                found.extend(inner or [Block((row.op,), row.inside, row.flops)])
    return sorted(found, key=lambda block: -block.saving), total


def _runs(rows: Sequence[Any]) -> List[Block]:
    """A Sequential's layers cut into runs of about sqrt(n): recomputing every
    run keeps n/sqrt(n) outputs plus one run's, instead of all n."""
    if len({id(row.op) for row in rows}) < len(rows):  # a layer called twice: no chain to cut
        return []
    size = max(1, round(math.sqrt(len(rows))))
    found = []
    for start in range(0, len(rows), size):
        run = rows[start:start + size]
        saving = sum(row.inside for row in run) + sum(row.produced - row.inside for row in run[:-1])
        flops = None if any(row.flops is None for row in run) else sum(row.flops for row in run)
        if saving:
            found.append(Block(tuple(row.op for row in run), saving, flops))
    return found


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
        self._forced: Optional[List[Block]] = None
        if isinstance(setting, (list, tuple)):
            names = {layer.name: layer for layer in model.layers}
            missing = [name for name in setting if name not in names]
            if missing:
                raise ValueError(
                    f"remat names layers that model '{model.name}' does not have at its top "
                    f"level: {missing}; its layers are {sorted(names)}. Received remat={setting!r}"
                )
            self._forced = [Block((names[name],), 0, None) for name in setting]
        self._applied: List[Block] = []
        self._patched: List[Any] = []  # the layers (or the Sequential) whose call is ours

    def _chosen(self, signature: Hashable) -> List[Block]:
        if self._forced is not None:
            return self._forced
        count = self._counts.get(signature, 0)
        if not count:
            return []
        return self._candidates()[:count]

    def _candidates(self, x: Any = None) -> List[Block]:
        """The blocks, found at the first need (once per model; `x`: the batch's inputs)."""
        if self._blocks is None:
            if self.model not in _BLOCKS:
                _BLOCKS[self.model] = _blocks_or_none(self.model, x)
            self._blocks, self._total_flops = _BLOCKS[self.model]
        return self._blocks

    def names(self, signature: Hashable) -> Tuple[str, ...]:
        """The names of the layers recomputed for batches of `signature`."""
        return tuple(layer.name for block in self._chosen(signature) for layer in block.layers)

    def apply(self, signature: Hashable) -> Tuple[str, ...]:
        """Wrap exactly the layers recomputed for `signature`; returns their names."""
        chosen = self._chosen(signature)
        if chosen != self._applied:
            self.release()
            if chosen and isinstance(self.model, keras.Sequential):
                self.model.call = _call_in_parts(self.model, chosen)
                self._patched.append(self.model)
            else:
                for block in chosen:
                    _wrap(block.layers[0])
                    self._patched.append(block.layers[0])
            self._applied = chosen
        return self.names(signature)

    def escalate(self, signature: Hashable, x: Any = None) -> bool:
        """Recompute more layers for `signature` after one sample ran out of memory
        (`x`: the batch's inputs, whose lengths fill the model's unknown dimensions).

        Returns:
            False when there is nothing more to recompute (`setting` False or
            a list, or every block already is).
        """
        if self.setting != "auto":
            return False
        candidates = self._candidates(x)
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
        for patched in self._patched:
            del patched.call
        self._patched, self._applied = [], []


def _blocks_or_none(model: keras.Model, x: Any) -> Tuple[List[Block], int]:
    """`blocks(model)`, traced at the lengths of `x` where the model leaves them unknown
    (a KerasHub model's tokens); none where the analysis fails."""
    _backend.get().materialize(model)  # inside Keras's JAX loop: the variables, readable
    shapes = [tuple(leaf.shape) for leaf in keras.tree.flatten(x) if hasattr(leaf, "shape")]
    length = shapes[0][1] if shapes and len(shapes[0]) > 1 else None
    length = None if length is None else int(length)
    try:
        with _lengths.given(length):
            return blocks(model)
    except Exception as err:  # noqa: BLE001 - nothing to recompute: MemFit raises as before
        logger.debug("no blocks to recompute in %s: %s", getattr(model, "name", model), err)
        return [], 0


def _wrap(layer: Any) -> None:
    """Make `layer`'s call recompute in the backward pass, exactly (`del layer.call` undoes it).

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


def _call_in_parts(model: keras.Sequential, chosen: Sequence[Block]) -> Callable:
    """A call for `model` that runs its layers as functional parts: each chosen
    block one part, recomputed (`_wrap`), the layers between them as they are."""
    part_of = {id(layer): i for i, block in enumerate(chosen) for layer in block.layers}
    runs: List[List[Any]] = []
    for layer in model.layers:
        if not runs or part_of.get(id(layer)) != part_of.get(id(runs[-1][-1])):
            runs.append([])
        runs[-1].append(layer)
    parts = []
    for run in runs:
        part = keras.Model(run[0].input, run[-1].output, name=f"{model.name}_{run[0].name}")
        if id(run[0]) in part_of:
            _wrap(part)
        parts.append(part)

    def call(inputs: Any, training: Optional[bool] = None, mask: Any = None) -> Any:
        outputs = inputs
        for part in parts:
            outputs = part(outputs, training=training)
        return outputs

    return call
