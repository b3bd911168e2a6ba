"""`ModelAnalysis`: one analysis of a model (a row per top-level call, peaks per device)."""

from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import keras

from keras_memfit import backend as _backend
from keras_memfit._internal import keras_compat as _keras_compat
from keras_memfit.analysis.flops import flops_per_sample
from keras_memfit.analysis.graph import LayerGraph
from keras_memfit.analysis.peak import DeviceMemory, Step, VariableBytes, device_steps, estimate
from keras_memfit.analysis.sizes import ByteCounter, size, slot_bytes

OTHER_WEIGHTS = "(other weights)"
logger = logging.getLogger("keras_memfit")


@dataclasses.dataclass(frozen=True)
class Row:
    """One top-level call of the forward pass (or, `op` None, the weights no call owns).

    Per sample: `produced` by it and its sublayers (`inside`: not its outputs, what recomputing
    it frees), `working` at its busiest, `cut` alive after it. Weights count at their first call.
    """

    op: Any
    name: str
    class_name: str
    output_shape: tuple
    params: int
    param_bytes: int
    trainable_bytes: int
    slot_bytes: int  # of its trainable weights
    produced: int
    working: int
    cut: int
    flops: Optional[int]
    devices: Tuple[str, ...]
    inside: int = 0


def short_device(name: str) -> str:
    """A device name in short form ("/device:GPU:0", "/GPU:0" -> "GPU:0"); "" if unparsable."""
    name = name.rsplit("device:", 1)[-1].strip().lstrip("/")
    kind, _, index = name.partition(":")
    if not kind or not kind.isalpha() or (index and not index.isdigit()):
        return ""
    return f"{kind.upper()}:{int(index) if index else 0}"


def check_built(model: keras.Model) -> None:
    """Raise `ValueError` where some layer of `model` is not built (tracing would build it)."""
    unbuilt = [layer.name for layer in _keras_compat.all_layers(model) if not layer.built]
    if unbuilt:
        raise ValueError(
            f"the model {model.name!r} has not been built, so its layers' shapes are "
            f"unknown; received a model with unbuilt layers {unbuilt[:5]}. Build it "
            "first, as `model.summary()` needs too: call it on a batch (a subclassed "
            "model's `build(input_shape)` builds its layers only if it defines "
            "`build`), or give a Sequential model a `keras.Input(shape)` first layer."
        )


def analyse(model: keras.Model, policy: Any = None) -> "ModelAnalysis":
    """Trace a built `model` once and analyse it (`policy`: a `keras.DTypePolicy`, or None)."""
    check_built(model)
    counter = ByteCounter(policy)
    graph = LayerGraph(_backend.get().trace_layer_calls(model), counter.tensor)
    return ModelAnalysis(model, counter, graph)


def training_peak(model: keras.Model) -> Callable[[int], Optional[int]]:
    """`peak_at(rows)`: the training peak estimate in bytes, analysed at its first call, or None."""
    model_ref = weakref.ref(model)
    memo: Dict[str, Any] = {}

    def peak_at(rows: int) -> Optional[int]:
        if "estimate" not in memo:
            memo["estimate"] = None
            target = model_ref()
            if target is not None:
                try:
                    memo["estimate"] = analyse(target).peak(training=True)[1]
                except Exception as exc:  # advisory: the caller decides without it
                    logger.debug("No training peak estimate for %r (%s)", target.name, exc)
        estimate = memo["estimate"]
        return None if estimate is None else estimate.peak_bytes_at(rows)

    return peak_at


class ModelAnalysis:
    """Sizes, traced graph, rows and peak estimates of one model (untraced: weights and slots)."""

    def __init__(self, model: keras.Model, counter: ByteCounter,
                 graph: Optional[LayerGraph] = None) -> None:
        self.model = model
        self.counter = counter
        self.graph = graph
        self.slots = slot_bytes(model, counter)
        self.slots_resident = bool(getattr(getattr(model, "optimizer", None), "built", False))
        self.rows: List[Row] = []
        self.variables: List[VariableBytes] = []
        self.input_bytes_per_sample = 0
        if graph is not None:
            self._add_rows(graph)

    # ------------------------------------------------------------ counting
    def slot_bytes_of(self, variable: Any) -> int:
        """Bytes of a variable's optimizer slots (0 for a non-trainable one)."""
        return self.slots.get(id(variable), 0) if variable.trainable else 0

    def weights_bytes(self, weights: Iterable[Any]) -> int:
        """Bytes of `weights` plus their optimizer slots."""
        return sum(self.counter.variable(v) + self.slot_bytes_of(v) for v in weights)

    def crossing(self, layers: Iterable[Any]) -> int:
        """Bytes per sample crossing between top-level `layers` and the rest (0 untraced)."""
        return 0 if self.graph is None else self.graph.crossing(layers)

    def first_row(self, layer: Any) -> Optional[Row]:
        """The row of `layer`'s first top-level call, or None."""
        return next((row for row in self.rows if row.op is layer), None)

    def _add_rows(self, graph: LayerGraph) -> None:
        variable_device = _backend.get().variable_device
        seen: set = set()
        calls_of: Dict[int, int] = {}
        cuts = graph.cuts(graph.top)

        def row(op, name, class_name, output_shape, weights, **per_sample) -> Row:
            # JAX names a device "cpu:0": in short form, "CPU:0".
            found = [VariableBytes(short_device(variable_device(v) or ""), self.counter.variable(v),
                                   self.slot_bytes_of(v), bool(v.trainable)) for v in weights]
            self.variables.extend(found)
            return Row(
                op=op, name=name, class_name=class_name, output_shape=output_shape,
                params=sum(size(v.shape) for v in weights),
                param_bytes=sum(b.nbytes for b in found),
                slot_bytes=sum(b.slot_bytes for b in found),
                trainable_bytes=sum(b.nbytes for b in found if b.trainable),
                devices=tuple(sorted({b.device for b in found} - {""})), **per_sample,
            )

        for position, index in enumerate(graph.top):
            call = graph.calls[index]
            op = call.op
            count = calls_of[id(op)] = calls_of.get(id(op), 0) + 1
            weights = [v for v in getattr(op, "weights", []) if id(v) not in seen]
            seen.update(id(v) for v in weights)
            outputs = [t.shape[1:] for t in call.outputs]
            self.rows.append(row(
                op, op.name if count == 1 else f"{op.name} (call {count})", type(op).__name__,
                outputs[0] if len(outputs) == 1 else tuple(outputs), weights,
                produced=sum(graph.sizes[k] for k in graph.produced(index)),
                inside=sum(graph.sizes[k] for k in set(graph.produced(index)) - {
                    t.key for t in call.outputs}),
                working=graph.working(index), cut=cuts[position],
                flops=flops_per_sample(graph, index),
            ))
        # Weights no traced call owns: the model's own, or layers its call skips.
        others = [v for v in self.model.weights if id(v) not in seen]
        if others:
            self.rows.append(row(None, OTHER_WEIGHTS, "-", (), others,
                                 produced=0, working=0, cut=0, flops=0))
        self.input_bytes_per_sample = sum(graph.sizes[k] for k in dict.fromkeys(graph.input_keys))

    # ------------------------------------------------------------ estimate
    def peak(
        self, *, training: bool, device: Optional[str] = None
    ) -> Tuple[Optional[str], DeviceMemory, Dict[str, DeviceMemory]]:
        """The peak estimate of one step, for the model or for one of its devices.

        `device` None: the non-host device holding the most weight bytes. Returns (the device,
        None without variables; its estimate; every device's).
        """
        devices = sorted({v.device for v in self.variables} - {""})
        wanted = None if device is None else short_device(device)
        if wanted is not None and devices and wanted not in devices:
            raise ValueError(
                "device must be one of the devices the model's variables live on "
                f"({', '.join(devices)}); received device={device!r}"
            )
        steps = [Step(row.produced, row.working, row.cut) for row in self.rows]
        if len(devices) <= 1 or self.graph is None:
            wanted = wanted or (devices[0] if devices else None)
            whole = estimate(steps, self.variables, self.input_bytes_per_sample,
                             training=training, slots_resident=self.slots_resident,
                             device=wanted)
            return wanted, whole, ({} if wanted is None else {wanted: whole})
        host = _backend.get().host_device().lstrip("/")
        weight_bytes = {d: sum(v.nbytes for v in self.variables if v.device == d)
                        for d in devices}
        default = sorted(devices, key=lambda d: (d == host, -weight_bytes[d], d))[0]
        top_rows = [row for row in self.rows if row.op is not None]
        sides = [row.devices[0] if len(row.devices) == 1 else default for row in top_rows]
        per_device = {}
        for name in devices:
            here_steps, inputs = device_steps(self.graph, sides, default, name)
            mine = [v for v in self.variables if (v.device or default) == name]
            per_device[name] = estimate(here_steps, mine, inputs, training=training,
                                        slots_resident=self.slots_resident, device=name)
        wanted = wanted or default
        return wanted, per_device[wanted], per_device
