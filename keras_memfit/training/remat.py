"""MemFit's rung after splitting: recomputing layers in the backward pass (rematerialization).

Blocks found by the model's analysis run through the backend's `checkpoint` (docs/training.md).
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import Any, Callable, Dict, Hashable, List, NamedTuple, Optional, Sequence, Tuple, Union

import keras

from keras_memfit import backend as _backend
from keras_memfit._internal import keras_compat as _keras_compat
from keras_memfit._internal import sequence_lengths as _lengths
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

    `saving`: estimated bytes per sample freed; `owner`: a weakref to the functional model
    whose calls `span` the segment is (None: one layer); `top`: its `memory_report` row's call.
    """

    layers: Tuple[Any, ...]
    saving: int
    flops: Optional[int]
    owner: Optional["weakref.ref"] = None
    span: Tuple[int, int] = (0, 0)
    top: Any = None


class Found(NamedTuple):
    """Blocks, forward FLOPs per sample, heaviest layer need (without, with column matrices)."""

    blocks: List[Block]
    flops: int
    heaviest: Tuple[Optional[LayerNeed], Optional[LayerNeed]]


def blocks(model: keras.Model, analysis: Optional[ModelAnalysis] = None) -> Tuple[List[Block], int]:
    """The blocks worth recomputing, largest saving first, and forward FLOPs per sample."""
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
    """A nested functional model's own blocks (recomputed whole, it would free nothing)."""
    if not isinstance(op, keras.Model) or _keras_compat.functional_graph(op) is None:
        return []
    return [dataclasses.replace(block, top=op) for block in blocks(op)[0]]


def _embeds(op: Any) -> bool:
    """Whether `op` holds an `Embedding` (recomputed, its table's gradient would be dense)."""
    return isinstance(op, keras.layers.Layer) and any(
        isinstance(layer, keras.layers.Embedding) for layer in _keras_compat.all_layers(op))


def _layer_blocks(rows: Sequence[Row]) -> List[Block]:
    """The blocks of a model without a graph: its top-level layers holding tensors inside."""
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
    """A functional model's graph cut into segments (nested functional models in turn)."""
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
    # tensor key -> the position of its last consumer
    last = {key: p for p, index in enumerate(graph.top) for key in graph.consumed(index)}
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
    names = isinstance(remat, (list, tuple)) and remat and all(isinstance(n, str) for n in remat)
    if not (remat == "auto" or remat is False or names):
        raise ValueError(
            f'remat must be "auto", False or a list of layer names; received remat={remat!r}'
        )


class Rematerialization:
    """Which layers of one model MemFit recomputes, per input signature, and their wrapping."""

    def __init__(self, model: keras.Model, setting: Setting) -> None:
        self.model = model
        self.setting = setting
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
        return self._candidates()[:count] if count else []

    def _analysed(self, x: Any = None) -> Found:
        """The analysis's findings, made once per model (`x`: batch inputs)."""
        if self.model not in _BLOCKS:
            _BLOCKS[self.model] = _find(self.model, x)
        return _BLOCKS[self.model]

    def _candidates(self, x: Any = None) -> List[Block]:
        return self._analysed(x).blocks

    def names(self, signature: Hashable) -> Tuple[str, ...]:
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
        """Recompute more layers for `signature`; False when there are no more."""
        if self.setting != "auto":
            return False
        candidates = self._candidates(x)
        count = self._counts.get(signature, 0)
        if count >= len(candidates):
            return False
        self._counts[signature] = min(len(candidates), max(1, 2 * count))
        return True

    def heaviest(self, columns: bool, x: Any = None) -> Optional[LayerNeed]:
        """The layer whose own backward pass needs the most (column matrices where `columns`)."""
        return self._analysed(x).heaviest[columns]

    def step_time(self, signature: Hashable) -> Optional[float]:
        """The estimated step time over that without recomputation, or None."""
        total = self._analysed().flops
        if self._forced is not None or not total:
            return None
        flops = [block.flops for block in self._candidates()[:self._counts.get(signature, 0)]]
        if None in flops:
            return None
        return round(1 + sum(flops) / (3 * total), 2)

    def saving(self, signature: Hashable) -> int:
        if self._forced is not None:
            return 0
        return sum(block.saving for block in self._candidates()[:self._counts.get(signature, 0)])

    def release(self) -> None:
        for patched in self._patched:
            del patched.call
        self._patched, self._applied = [], []


def _named_blocks(model: keras.Model, named: Sequence[Any]) -> List[Block]:
    """The blocks recomputing the `named` layers (consecutive calls in a graph: one segment)."""
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
    """The analysis's findings, traced at the lengths of `x`; nothing where it fails."""
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
    """Make `layer`'s call recompute in the backward pass (`del layer.call` undoes it).

    Arguments at the flat positions `fixed` (no gradient) are closed over: `tf.recompute_grad`
    would compute a gradient for every input.
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
    """A call for the functional `owner` running each span of `recomputed` as a recomputed
    part (`trained`: `owner` is the trained model, whose inputs get no gradient)."""
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
    # id of a tensor -> the position of its last consumer
    last = {id(t): position for position, node in enumerate(nodes) for t in node.inputs}
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
