"""`place`: keep oversized, cheap-to-compute layers on the host, the rest on the accelerator."""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable, Dict, Iterable, List, Optional, Union

import keras

from keras_memfit import backend as backend_seam
from keras_memfit._internal import cache as _cache
from keras_memfit._internal import keras_compat as _keras_compat
from keras_memfit._internal import model_state as _model_state
from keras_memfit._internal import validate as _validate
from keras_memfit._internal.units import format_bytes
from keras_memfit.analysis import ModelAnalysis, analyse, placement_choice
from keras_memfit.analysis.sizes import ByteCounter

logger = logging.getLogger("keras_memfit")

#: Share of the accelerator's budget weights and optimizer slots may use (the rest: activations).
WEIGHT_SHARE = 0.5
#: With no budget known, a cheap layer is pinned only from this many bytes of weights and slots.
OVERSIZED_BYTES = 1 << 30
#: Where pinning every cheap layer cannot fit, only those holding this share stay pinned.
DOMINANT_SHARE = 0.1
_STATE = "_memfit_placement"
_said_no_accelerator = False


@dataclasses.dataclass
class PlacementPlan:
    """Where `place` put a model's layers, and why.

    Attributes:
        accelerator: The device the rest lives on (None when there is none).
        device_bytes: Bytes of weights plus optimizer slots on each device.
        crossing_bytes_per_sample: Bytes per sample crossing between host and accelerator
            top-level layers (model inputs not counted); 0 for a model that cannot be traced.
        applied: Whether some layer is pinned to the host.
        layer_bytes: Weights plus slots of each top-level layer with weights.
    """

    cpu_layers: List[str]
    accelerator: Optional[str]
    host: str
    device_bytes: Dict[str, int]
    crossing_bytes_per_sample: int
    applied: bool
    reason: str
    layer_bytes: Dict[str, int] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict:
        """The plan as plain Python values (JSON-serialisable)."""
        return dataclasses.asdict(self)

    def summary(self, print_fn: Optional[Callable[[str], None]] = None) -> None:
        """Print the plan as a small table, a `print_fn` call (default `print`) per line."""
        print_fn = print if print_fn is None else print_fn
        for line in str(self).splitlines():
            print_fn(line)

    def __str__(self) -> str:
        state = "applied" if self.applied else "nothing pinned"
        lines = [f"keras_memfit placement ({state})"]
        pinned = set(self.cpu_layers)
        if self.layer_bytes:
            width = max(len("layer"), *(len(n) for n in self.layer_bytes))
            lines.append(f"  {'layer':<{width}}  {'device':<8}  weights+slots")
            for name, size in self.layer_bytes.items():
                device = self.host if name in pinned else (self.accelerator or self.host)
                lines.append(f"  {name:<{width}}  {device:<8}  {format_bytes(size)}")
        for device, size in self.device_bytes.items():
            lines.append(f"  total on {device}: {format_bytes(size)}")
        lines.append(f"  crossing per sample: {format_bytes(self.crossing_bytes_per_sample)}")
        lines.append(f"  reason: {self.reason}")
        return "\n".join(lines)


def place(
    model: keras.Model,
    budget: Optional[int] = None,
    *,
    cpu_layers: Optional[Iterable[Union[str, keras.layers.Layer]]] = None,
    accelerator: Optional[str] = None,
    verbose: bool = False,
) -> PlacementPlan:
    """Pin a model's oversized, cheap-to-compute layers to `/CPU:0`, the rest to the accelerator.

    Without `cpu_layers`, cheap top-level layers are pinned until the accelerator's weights and
    slots fit in `WEIGHT_SHARE` of `budget`. Outputs and training are unchanged; `jit_compile`
    is turned off while anything is pinned. The placement is not saved (docs/memory.md).

    Args:
        budget: Bytes available on the accelerator; None: its known limit, else only layers
            of at least `OVERSIZED_BYTES` are pinned.
        cpu_layers: Names or layers to pin instead of the automatic choice (nested layers
            too); an empty list pins nothing but places the model on the accelerator.
        accelerator: The device for the rest; default: the first GPU (none: nothing changes).

    Returns:
        The `PlacementPlan`.

    Raises:
        TypeError: If `model` is not a Keras model.
        ValueError: For a non-positive `budget`, an unknown layer name, an accelerator that
            does not exist or is the host, or an automatic choice on an unbuilt model.
        NotImplementedError: On a backend that cannot place layers (JAX, torch), or under a
            distribution strategy.
    """
    _validate.model(model)
    budget = _validate.positive_int("budget", budget)
    be = backend_seam.get()
    _refuse_distribution(be, model)
    host = be.host_device()
    accelerator = _resolve_accelerator(be, accelerator, host)
    if accelerator is not None and be.placement is None:
        raise NotImplementedError(
            f"keras_memfit.place is not implemented for the {keras.backend.backend()} "
            "backend: it cannot keep a layer on another device than the model's. Run "
            "the model without place(), or use KERAS_BACKEND=tensorflow for place()."
        )
    pinned = None if cpu_layers is None else _resolve_layers(model, cpu_layers)
    reason = "layers given by cpu_layers"
    if accelerator is None:
        global _said_no_accelerator
        if not _said_no_accelerator:
            logger.warning(
                "place(): no GPU is visible, so nothing changes: the whole "
                "model already runs on the CPU. Pass accelerator= to name another device."
            )
            _said_no_accelerator = True
        pinned, reason = [], "no accelerator: TensorFlow sees no GPU; nothing changed"
    analysis = ModelAnalysis(model, ByteCounter()) if accelerator is None else _analyse(model)
    sizes = placement_choice.layer_bytes(analysis, model.layers)
    if pinned is None:
        if not model.built:
            raise ValueError(
                "place() needs a built model to choose layers by size; received an "
                f"unbuilt {type(model).__name__} {model.name!r}. Call model.build("
                "input_shape) (or the model on a batch) first, or pass cpu_layers=."
            )
        if budget is None:
            limit = be.memory_limit(accelerator.lstrip("/"))
            budget = limit[0] if limit else None
        pinned, reason = placement_choice.choose(
            analysis, model.layers, sizes, budget, weight_share=WEIGHT_SHARE,
            oversized_bytes=OVERSIZED_BYTES, dominant_share=DOMINANT_SHARE)
    if accelerator is not None:
        _apply(model, be.placement, be.variable_device, host, accelerator, pinned)
    total = sum(sizes.values())
    on_host = sum(analysis.weights_bytes(layer.weights) for layer in pinned)
    if pinned:
        device_bytes = {host: on_host, accelerator: max(total - on_host, 0)}
    else:
        device_bytes = {accelerator or host: total}
    plan = PlacementPlan(
        cpu_layers=[layer.name for layer in pinned], accelerator=accelerator, host=host,
        device_bytes=device_bytes, crossing_bytes_per_sample=analysis.crossing(pinned),
        applied=bool(pinned), reason=reason, layer_bytes=dict(sizes),
    )
    if verbose:
        plan.summary()
    else:  # without an accelerator, at debug: the warning above said so, once per process
        logger.log(logging.DEBUG if accelerator is None else logging.INFO, "%s", plan)
    return plan


def _refuse_distribution(be: Any, model: keras.Model) -> None:
    """Raise `NotImplementedError` under a distribution strategy: its weights are per replica."""
    received = be.distribution_of(model)
    if received is not None:
        raise NotImplementedError(
            "place() cannot pin layers of a model that runs under a distribution "
            "strategy: each replica holds its own copy of the weights on its own "
            f"device. Received model '{model.name}' under {received} (built in a "
            "tf.distribute strategy's scope, called inside one, or under a "
            "keras.distribution). Under a strategy, safe_predict, safe_evaluate and "
            "MemFit split each batch across the replicas instead; to use place(), "
            "build and call the model outside the strategy."
        )


def _analyse(model: keras.Model) -> ModelAnalysis:
    """The model's analysis; untraced (sizes only, nothing crossing) when it cannot be traced."""
    if model.built:
        try:
            return analyse(model)
        except Exception as exc:  # the trace is advisory here
            logger.debug("place(): no traced graph for %r (%s)", model.name, exc)
    return ModelAnalysis(model, ByteCounter())


def _resolve_accelerator(be: Any, accelerator: Optional[str], host: str) -> Optional[str]:
    if accelerator is None:
        found = be.list_accelerators()
        return found[0] if found else None
    name = be.canonical_device(accelerator) if isinstance(accelerator, str) else None
    if name is None or not be.device_exists(name):
        raise ValueError(
            "accelerator must name an existing device such as '/GPU:0'; received "
            f"accelerator={accelerator!r}"
        )
    if name == host:
        raise ValueError(
            f"accelerator must differ from the host {host!r} that pinned layers use; "
            f"received accelerator={accelerator!r}"
        )
    return name


def _resolve_layers(model, cpu_layers) -> List[keras.layers.Layer]:
    if isinstance(cpu_layers, (str, keras.layers.Layer)):
        cpu_layers = [cpu_layers]
    try:
        cpu_layers = list(cpu_layers)
    except TypeError:
        raise ValueError(
            "cpu_layers must be a list of layer names or layers; received "
            f"cpu_layers={cpu_layers!r}"
        ) from None
    all_layers = [layer for layer in _keras_compat.all_layers(model) if layer is not model]
    by_name = {layer.name: layer for layer in all_layers}
    chosen = []
    for item in cpu_layers:
        layer = by_name.get(item) if isinstance(item, str) else item
        if not any(layer is known for known in all_layers):
            names = sorted(by_name)
            shown = ", ".join(names[:20]) + (", ..." if len(names) > 20 else "")
            raise ValueError(
                f"cpu_layers must name layers of model {model.name!r} ({shown}); "
                f"received {item!r}"
            )
        if layer not in chosen:
            chosen.append(layer)
    return chosen


# -------------------------------------------------------------------- apply
def _on_device(placer, device: str, method: Callable) -> Callable:
    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        with placer.device_scope(device):
            return method(*args, **kwargs)

    return wrapped


def _undo(model) -> None:
    """Remove the wrappers a previous `place` installed."""
    for obj, attr, original in model.__dict__.get(_STATE) or ():
        if original is None:
            obj.__dict__.pop(attr, None)
        else:
            object.__setattr__(obj, attr, original)
    object.__setattr__(model, _STATE, None)


def _apply(model, placer, variable_device, host, accelerator, pinned) -> None:
    _undo(model)
    wrapped = []

    def wrap(obj, attr, replacement):
        wrapped.append((obj, attr, obj.__dict__.get(attr)))
        object.__setattr__(obj, attr, replacement)

    # Inner scopes win: the model's ops on the accelerator, pinned layers on the host.
    wrap(model, "call", _on_device(placer, accelerator, model.call))
    for layer in pinned:  # forward and backward on the host
        wrap(layer, "call", functools.wraps(layer.call)(placer.call_on_device(host, layer.call)))
    # Variables not created yet, where they belong: a scope around `call` or `build` is lost
    # when Keras lifts a creation out of the traced graph.
    pinned_layers = {id(sub) for layer in pinned
                     for sub in _keras_compat.all_layers(layer)}
    for layer in _keras_compat.all_layers(model):
        device = host if id(layer) in pinned_layers else accelerator
        wrap(layer, "add_weight", placer.creating_on(device, layer.add_weight))

    pinned_ids = {id(v) for layer in pinned for v in layer.weights}
    moved = sum(
        placer.move_variable(v, host if id(v) in pinned_ids else accelerator)
        for v in model.weights
    )

    def settle():  # now and after each compile: slots on their variables' devices, XLA off
        optimizer = getattr(model, "optimizer", None)
        placer.follow_variable_devices(optimizer)
        if optimizer is not None and optimizer.built:
            for v in model.trainable_variables:
                device = variable_device(v)
                for slot in _model_state.slot_variables(optimizer, v):
                    placer.move_variable(slot, device)
        if pinned:
            _no_xla(model)

    settle()
    compile_method = model.compile

    @functools.wraps(compile_method)
    def compile(*args, **kwargs):
        compile_method(*args, **kwargs)
        settle()

    wrap(model, "compile", compile)
    object.__setattr__(model, _STATE, wrapped)
    for attr in ("train_function", "test_function", "predict_function"):
        setattr(model, attr, None)
    _cache.forget(model)
    logger.info(
        "place(): %d layer(s) on the host, %d variable(s) moved",
        len(pinned), moved,
    )


def _no_xla(model) -> None:
    try:
        was_on = bool(model.jit_compile)  # resolves "auto" (on for a GPU)
    except Exception:  # a model without Keras's trainer
        was_on = False
    if was_on:
        logger.info(
            "place(): jit_compile turned off for %r: an XLA cluster runs on one "
            "device and cannot span the host and the accelerator", model.name,
        )
    model.jit_compile = False
