"""MemFit's rung after splitting: recomputing layers in the backward pass (rematerialization).

Splitting a batch helps until a piece is one sample. When one sample runs
out of memory in training, MemFit recomputes parts of the model in the
backward pass instead of keeping what they produce inside (the backend's
`checkpoint`: `tf.recompute_grad`, `jax.checkpoint`, torch's non-reentrant
`checkpoint`), and runs the batch again. The parts come from the model's
analysis (`keras_memfit.analysis`, what `memory_report` shows): the graph of
a functional model (a Sequential's too) cut into segments where few bytes
are alive (`analysis.segments`), each run as a functional part; a nested
functional model's own segments (a KerasHub task's backbone); in a
subclassed model, each top-level layer that holds tensors inside beyond its
outputs (a transformer block). The largest saving first, each OOM at one
sample doubles how many are recomputed (1, 2, 4, ... all); the number is
remembered per model and input signature, so a later `fit` starts there.
What one layer's own backward pass needs (`analysis.backward`) no
recomputation frees: where that alone is more than is free, MemFit says so.

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
from typing import Any, Callable, Dict, Hashable, List, NamedTuple, Optional, Sequence, Tuple, Union

import keras

from keras_memfit import backend as _backend
from keras_memfit._internal import keras_compat as _keras_compat
from keras_memfit._internal import lengths as _lengths
from keras_memfit.analysis import ModelAnalysis, Row, analyse
from keras_memfit.analysis.backward import LayerNeed, heaviest
from keras_memfit.analysis.segments import cut

logger = logging.getLogger("keras_memfit")

Setting = Union[str, bool, Sequence[str]]

# Per model: how many blocks each input signature recomputes, and what its analysis found.
_COUNTS: "weakref.WeakKeyDictionary[Any, Dict[Hashable, int]]" = weakref.WeakKeyDictionary()
_BLOCKS: "weakref.WeakKeyDictionary[Any, Found]" = weakref.WeakKeyDictionary()


@dataclasses.dataclass(frozen=True)
class Block:
    """Calls MemFit may recompute together: a segment of a functional graph, or one layer.

    Attributes:
        layers: The layers, in call order.
        saving: Bytes per sample they make inside that nothing after them
            uses (what recomputing them frees, estimated).
        flops: Their forward FLOPs per sample, or None where unknown.
        owner: The functional model whose graph the segment cuts, held
            weakly (`span`: its calls start..stop-1), or None for one layer
            recomputed wherever it is called.
        span: The segment's positions in `owner`'s graph.
        top: The call of the analysed model the block lies in (its first
            call, or the nested model holding it): its `memory_report` row.
    """

    layers: Tuple[Any, ...]
    saving: int
    flops: Optional[int]
    owner: Optional["weakref.ref"] = None
    span: Tuple[int, int] = (0, 0)
    top: Any = None


class Found(NamedTuple):
    """What one analysis of a model found for the rung: its blocks (largest saving
    first), its forward FLOPs per sample, and its heaviest layer's backward need
    without and with convolutions' column matrices."""

    blocks: List[Block]
    flops: int
    heaviest: Tuple[Optional[LayerNeed], Optional[LayerNeed]]


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
    rows = [row for row in analysis.rows if row.op is not None]
    total = sum(row.flops or 0 for row in analysis.rows)
    graph = _keras_compat.functional_graph(model)
    if graph is not None and len(graph.nodes) == len(rows) and all(
            node.op is row.op for node, row in zip(graph.nodes, rows)):
        found = _segments(model, analysis, rows)
    else:
        found = _layer_blocks(rows)
    return sorted(found, key=lambda block: -block.saving), total


def _nested(op: Any) -> List[Block]:
    """A nested functional model's own blocks, shown on its row (recomputed
    whole, it would free nothing at its backward pass's peak)."""
    if not isinstance(op, keras.Model) or _keras_compat.functional_graph(op) is None:
        return []
    return [dataclasses.replace(block, top=op) for block in blocks(op)[0]]


def _embeds(op: Any) -> bool:
    """Whether `op` holds an `Embedding`: recomputed (`tf.recompute_grad`), its
    table's gradient would be dense, the size of the table."""
    return isinstance(op, keras.layers.Layer) and any(
        isinstance(layer, keras.layers.Embedding) for layer in _keras_compat.all_layers(op))


def _layer_blocks(rows: Sequence[Row]) -> List[Block]:
    """A model without a graph to cut: its top-level layers that hold tensors inside."""
    first: Dict[int, Row] = {}
    for row in rows:
        first.setdefault(id(row.op), row)  # a shared layer: its first call
    found = []
    for row in first.values():
        inner = _nested(row.op)
        if not inner and row.inside and isinstance(row.op, keras.layers.Layer) and not _embeds(
                row.op):
            inner = [Block((row.op,), row.inside, row.flops, top=row.op)]
        found.extend(inner)
    return found


def _segments(model: keras.Model, analysis: ModelAnalysis, rows: Sequence[Row]) -> List[Block]:
    """A functional model's graph cut into segments (`analysis.segments.cut`);
    a nested functional model is a segment of its own, cut in turn."""
    graph = analysis.graph
    n = len(rows)
    inner: Dict[int, List[Block]] = {}  # position -> a nested model's own blocks
    alone = set()  # positions never in a recomputed segment
    for p, row in enumerate(rows):
        nested = _nested(row.op)
        if nested:
            inner[p] = nested
        if nested or _embeds(row.op):
            alone.add(p)
    last: Dict[str, int] = {}  # tensor key -> the position of its last consumer
    for p, index in enumerate(graph.top):
        for key in graph.consumed(index):
            last[key] = p
    last.update((key, n) for key in graph.outputs)
    seen = set(graph.input_keys)
    tensors = []
    for p, index in enumerate(graph.top):
        outputs = {t.key for t in graph.calls[index].outputs}
        made = []
        for key in graph.produced(index):
            if key in seen or (p in inner and key not in outputs):
                continue  # made before, or by a nested model's own segments
            seen.add(key)
            made.append((graph.sizes[key], last.get(key, p)))
        tensors.append(made)
    found = [block for nested in inner.values() for block in nested]
    owner = weakref.ref(model)
    for start, stop, frees in cut(tensors, alone=alone):
        span = rows[start:stop]
        layers = tuple(row.op for row in span if isinstance(row.op, keras.layers.Layer))
        if frees and layers and start not in alone:
            flops = None if any(row.flops is None for row in span) else sum(
                row.flops for row in span)
            found.append(Block(layers, frees, flops, owner, (start, stop), span[0].op))
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
            (never) or the names of the layers to recompute from the start
            (a nested model's layers too).

    Raises:
        ValueError: If a name in `setting` is not a layer of `model`.
    """

    def __init__(self, model: keras.Model, setting: Setting) -> None:
        self.model = model
        self.setting = setting
        self._found: Optional[Found] = None
        # Per input signature, how many blocks are recomputed (remembered per model).
        self._counts: Dict[Hashable, int] = (
            _COUNTS.setdefault(model, {}) if setting == "auto" else {})
        self._forced: Optional[List[Block]] = None
        if isinstance(setting, (list, tuple)):
            names: Dict[str, Any] = {}
            for layer in _keras_compat.all_layers(model):
                if layer is not model:
                    names.setdefault(layer.name, layer)
            missing = [name for name in setting if name not in names]
            if missing:
                shown = sorted(names)
                more = f" and {len(shown) - 40} more" if len(shown) > 40 else ""
                raise ValueError(
                    f"remat names layers that model '{model.name}' does not have: {missing}; "
                    f"its layers are {shown[:40]}{more}. Received remat={setting!r}"
                )
            self._forced = _named_blocks(model, [names[name] for name in setting])
        self._applied: List[Block] = []
        self._patched: List[Any] = []  # the layers (or functional models) whose call is ours

    def _chosen(self, signature: Hashable) -> List[Block]:
        if self._forced is not None:
            return self._forced
        count = self._counts.get(signature, 0)
        if not count:
            return []
        return self._candidates()[:count]

    def _analysed(self, x: Any = None) -> Found:
        """What the model's analysis found, at the first need (once per model;
        `x`: the batch's inputs)."""
        if self._found is None:
            if self.model not in _BLOCKS:
                _BLOCKS[self.model] = _find(self.model, x)
            self._found = _BLOCKS[self.model]
        return self._found

    def _candidates(self, x: Any = None) -> List[Block]:
        return self._analysed(x).blocks

    def names(self, signature: Hashable) -> Tuple[str, ...]:
        """The names of the layers recomputed for batches of `signature`."""
        return tuple(dict.fromkeys(
            layer.name for block in self._chosen(signature) for layer in block.layers))

    def apply(self, signature: Hashable) -> Tuple[str, ...]:
        """Wrap exactly the layers recomputed for `signature`; returns their names."""
        chosen = self._chosen(signature)
        if chosen != self._applied:
            self.release()
            spans: Dict[int, Tuple[Any, List[Tuple[int, int]]]] = {}
            for block in chosen:
                if block.owner is None:
                    _wrap(block.layers[0])
                    self._patched.append(block.layers[0])
                else:
                    owner = block.owner()
                    spans.setdefault(id(owner), (owner, []))[1].append(block.span)
            for owner, recomputed in spans.values():
                owner.call = _call_in_parts(owner, recomputed, owner is self.model)
                self._patched.append(owner)
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

    def heaviest(self, columns: bool, x: Any = None) -> Optional[LayerNeed]:
        """The layer whose own backward pass needs the most (`analysis.backward`),
        with convolutions' column matrices where `columns`; None where unknown."""
        return self._analysed(x).heaviest[columns]

    def step_time(self, signature: Hashable) -> Optional[float]:
        """The estimated step time over that without recomputation, or None.

        A train step costs about three forward passes; the recomputation
        adds the recomputed layers' forward FLOPs once more.
        """
        total = self._analysed().flops
        if self._forced is not None or not total:
            return None
        flops = [block.flops for block in self._candidates()[:self._counts.get(signature, 0)]]
        if None in flops:
            return None
        return round(1 + sum(flops) / (3 * total), 2)

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


def _named_blocks(model: keras.Model, named: Sequence[Any]) -> List[Block]:
    """The blocks recomputing the `named` layers: in a functional graph (the model's
    or a nested one's), each run of consecutive calls of them one segment; a
    layer called nowhere in one, recomputed wherever it is called."""
    wanted = {id(layer) for layer in named}
    found: List[Block] = []
    cut: set = set()  # the named layers a segment holds
    for owner in _keras_compat.all_layers(model):
        graph = _keras_compat.functional_graph(owner) if isinstance(owner, keras.Model) else None
        if graph is None:
            continue
        runs: List[List[int]] = []
        for position, node in enumerate(graph.nodes):
            if id(node.op) not in wanted:
                continue
            if runs and runs[-1][-1] == position - 1:
                runs[-1].append(position)
            else:
                runs.append([position])
        for run in runs:
            layers = tuple(dict.fromkeys(graph.nodes[p].op for p in run))
            found.append(Block(layers, 0, None, weakref.ref(owner), (run[0], run[-1] + 1)))
            cut.update(id(layer) for layer in layers)
    return found + [Block((layer,), 0, None) for layer in named if id(layer) not in cut]


def _find(model: keras.Model, x: Any) -> Found:
    """What the rung needs of `model`'s analysis, traced at the lengths of `x` where
    the model leaves them unknown (a KerasHub model's tokens); nothing where the
    analysis fails."""
    _backend.get().materialize(model)  # inside Keras's JAX loop: the variables, readable
    shapes = [tuple(leaf.shape) for leaf in keras.tree.flatten(x) if hasattr(leaf, "shape")]
    length = shapes[0][1] if shapes and len(shapes[0]) > 1 else None
    length = None if length is None else int(length)
    try:
        with _lengths.given(length):
            analysis = analyse(model)
            found, flops = blocks(model, analysis)
            return Found(found, flops, (heaviest(analysis.graph, False),
                                        heaviest(analysis.graph, True)))
    except Exception as err:  # noqa: BLE001 - nothing to recompute: MemFit raises as before
        logger.debug("no blocks to recompute in %s: %s", getattr(model, "name", model), err)
        return Found([], 0, (None, None))


def _wrap(layer: Any, fixed: Sequence[int] = ()) -> None:
    """Make `layer`'s call recompute in the backward pass, exactly (`del layer.call` undoes it).

    The call's tensor arguments become the recomputed function's inputs,
    with copies of the layer's non-trainable state (not its frozen weights,
    LoRA's base kernel: the call only reads them); everything else
    (`training=`, masks given as None, Python values, and the arguments at
    the flat positions `fixed`, which no gradient reaches) is closed over:
    `tf.recompute_grad` computes a gradient for each input, and that of an
    image (a convolution's input gradient) can outweigh what recomputing
    frees. A symbolic call (Keras tensors) runs as it is.
    """
    original = layer.call
    checkpoint = _backend.get().checkpoint
    # The state a call may assign; frozen weights (LoRA's base kernel) it only reads.
    frozen = {id(v) for sub in _keras_compat.all_layers(layer)
              for v in _keras_compat.made_trainable(sub)}
    state = [v for v in layer.non_trainable_variables if id(v) not in frozen]

    def call(*args: Any, **kwargs: Any) -> Any:
        leaves = keras.tree.flatten((args, kwargs))
        if any(isinstance(leaf, keras.KerasTensor) for leaf in leaves):
            return original(*args, **kwargs)
        is_tensor = [keras.ops.is_tensor(leaf) and i not in fixed for i, leaf in enumerate(leaves)]
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


def _call_in_parts(owner: Any, recomputed: Sequence[Tuple[int, int]], trained: bool) -> Callable:
    """A call for the functional `owner` that runs its graph as functional parts:
    each span of `recomputed` one part, recomputed (`_wrap`), the calls between
    them parts run as they are. A part takes the tensors its calls use from
    before it and returns those used after it. Where `owner` is the model
    trained, its inputs and what only weightless calls make of them get no
    gradient."""
    graph = _keras_compat.functional_graph(owner)
    nodes = graph.nodes
    graded = set() if trained else {id(t) for t in keras.tree.flatten(graph.inputs)}
    for node in nodes:  # the tensors a gradient reaches
        if getattr(node.op, "trainable_weights", None) or any(id(t) in graded for t in node.inputs):
            graded.update(id(t) for t in node.outputs)
    parts: List[Tuple[int, int, bool]] = []
    position = 0
    for start, stop in sorted(recomputed):
        if position < start:
            parts.append((position, start, False))
        parts.append((start, stop, True))
        position = stop
    if position < len(nodes):
        parts.append((position, len(nodes), False))
    last: Dict[int, int] = {}  # id of a tensor -> the position of its last consumer
    for position, node in enumerate(nodes):
        last.update((id(t), position) for t in node.inputs)
    last.update((id(t), len(nodes)) for t in keras.tree.flatten(graph.outputs))
    values = {id(t): t for t in keras.tree.flatten(graph.inputs)}
    for start, stop, recompute in parts:
        inside = nodes[start:stop]
        made = {id(t) for node in inside for t in node.outputs}
        taken = {id(t): t for node in inside for t in node.inputs if id(t) not in made}
        inputs = list(taken.values())
        outputs = [t for node in inside for t in node.outputs if last.get(id(t), -1) >= stop]
        part = keras.Model(inputs, outputs, name=f"{owner.name}_part{start}")
        if recompute:
            _wrap(part, [i for i, t in enumerate(inputs) if id(t) not in graded])
        results = keras.tree.flatten(part([values[id(t)] for t in inputs]))
        values.update((id(t), value) for t, value in zip(outputs, results))
    rebuilt = keras.Model(graph.inputs, keras.tree.map_structure(
        lambda t: values[id(t)], graph.outputs), name=owner.name)

    def call(inputs: Any, training: Optional[bool] = None, mask: Any = None, **kwargs: Any) -> Any:
        return rebuilt.call(inputs, training=training, mask=mask, **kwargs)

    return call
