"""Every use of Keras's private API shared by the backends; `TESTED_KERAS`: the range CI tests."""

from __future__ import annotations

import logging
import sys
from typing import Any, Iterable, NamedTuple, Optional, Tuple, Type

import keras

from keras_memfit._internal import sequence_lengths as _lengths

# The oldest and newest Keras that CI (.ci/run) tests.
TESTED_KERAS = ((3, 8), (3, 15))


def keras_version() -> tuple:
    """Keras's (major, minor), or () when the version string is unusual."""
    try:
        return tuple(int(p) for p in keras.__version__.split(".")[:2])
    except ValueError:
        return ()


def all_layers(model: keras.Model) -> Iterable[Any]:
    """The model and every layer nested in it (`Layer._flatten_layers`)."""
    return model._flatten_layers(include_self=True, recursive=True)


def calling_callback_list(callback: Any) -> Optional[Any]:
    """The `CallbackList` calling `callback`'s hook (`fit` hides it a few frames up), or None."""
    frame = sys._getframe(1)
    for _ in range(4):
        frame = frame.f_back
        if frame is None:
            return None
        caller = frame.f_locals.get("self")
        if isinstance(caller, keras.callbacks.CallbackList) and any(
                c is callback for c in caller.callbacks):
            return caller
    return None


def symbolic_build(model: keras.Model, data_batch: Any) -> None:
    """Build the model, its compiled metrics and loss (and optimizer) from one batch."""
    model._symbolic_build(data_batch=data_batch)


def has_per_output_loss_trackers(model: keras.Model) -> bool:
    """Whether the compiled loss tracks one loss per output (multi-output models)."""
    compile_loss = getattr(model, "_compile_loss", None)
    return bool(getattr(compile_loss, "metrics", None))


def per_output_loss_trackers(model: keras.Model) -> list:
    """Per-output loss `Mean`s, or []; each weights by the *static* batch size (1 if unknown)."""
    compile_loss = getattr(model, "_compile_loss", None)
    return [m for m in (getattr(compile_loss, "metrics", None) or []) if m is not None]


def layer_and_operation_classes() -> Tuple[Type[Any], Type[Any]]:
    """Keras's `Layer` and `Operation` base classes (whose `__call__` tracing wraps)."""
    from keras.src.layers.layer import Layer
    from keras.src.ops.operation import Operation

    return Layer, Operation


def input_structure(model: keras.Model) -> Tuple[Any, bool]:
    """`(inputs, positional)`, KerasTensors: call `model(inputs)` if positional, else `**inputs`."""
    struct = getattr(model, "_inputs_struct", None)
    if struct is None:  # a Sequential's is its `_functional`'s
        struct = getattr(getattr(model, "_functional", None), "_inputs_struct", None)
    if struct is not None:
        return keras.tree.map_structure(
            lambda t: keras.KerasTensor(_lengths.filled(model, t.shape), dtype=t.dtype), struct
        ), True
    shapes = getattr(model, "_build_shapes_dict", None)
    if not model.built or not shapes:
        raise ValueError(
            f"the model {model.name!r} has not been built, so its layers' shapes are "
            "unknown; received an unbuilt model. Build it first, as `model.summary()` "
            "needs too: call it on a batch, call `model.build(input_shape)`, or give a "
            "Sequential model a `keras.Input(shape)` first layer."
        )
    dtype = getattr(model, "input_dtype", None) or "float32"

    def tensors(shape):  # a shape, or a dict/list of them
        if isinstance(shape, dict):
            return {k: tensors(v) for k, v in shape.items()}
        if isinstance(shape, (tuple, list)) and shape and not all(
            d is None or isinstance(d, int) for d in shape
        ):
            return (list if isinstance(shape, list) else tuple)(tensors(v) for v in shape)
        return keras.KerasTensor(_lengths.filled(model, (None,) + tuple(shape[1:])), dtype=dtype)

    if len(shapes) == 1:
        (shape,) = shapes.values()
        return tensors(shape), True
    return {k.removesuffix("_shape"): tensors(s) for k, s in shapes.items()}, False


def data_adapter(
    x: Any, y: Any = None, sample_weight: Any = None, batch_size: Optional[int] = None
) -> Any:
    """Keras's own data adapter for `x`, unshuffled; ValueError if Keras does not take `x`."""
    from keras.src.trainers.data_adapters import get_data_adapter

    return get_data_adapter(
        x, y, sample_weight=sample_weight, batch_size=batch_size, shuffle=False
    )


def convolution_layer_classes() -> dict:
    """Keras's base classes of convolution and pooling layers, by role, for FLOP counts."""
    from keras.src.layers.convolutional.base_conv import BaseConv
    from keras.src.layers.convolutional.base_conv_transpose import BaseConvTranspose
    from keras.src.layers.convolutional.base_depthwise_conv import BaseDepthwiseConv
    from keras.src.layers.convolutional.base_separable_conv import BaseSeparableConv
    from keras.src.layers.pooling.base_global_pooling import BaseGlobalPooling
    from keras.src.layers.pooling.base_pooling import BasePooling

    return {
        "conv": BaseConv,
        "conv_transpose": BaseConvTranspose,
        "depthwise_conv": BaseDepthwiseConv,
        "separable_conv": BaseSeparableConv,
        "global_pooling": BaseGlobalPooling,
        "pooling": BasePooling,
    }


def flatten_metrics_in_order(model: keras.Model, logs: Any) -> Any:
    """`logs` as the list `model.evaluate` returns, in Keras's metric order."""
    return model._flatten_metrics_in_order(logs)


def built_input_shape(layer: Any) -> Any:
    """The one input shape `layer` was built with, or None (none, or several)."""
    shapes = getattr(layer, "_build_shapes_dict", None) or {}
    if len(shapes) == 1:
        return tuple(next(iter(shapes.values())))
    return None


# ---- Functional graphs (MemFit's recomputation) ----


class GraphNode(NamedTuple):
    """One call of a functional graph: the operation and its symbolic inputs and outputs."""

    op: Any
    inputs: Tuple[keras.KerasTensor, ...]
    outputs: Tuple[keras.KerasTensor, ...]


class FunctionalGraph(NamedTuple):
    """The graph a functional model runs: its nested `Input`s and outputs, its calls in order."""

    inputs: Any
    outputs: Any
    nodes: Tuple[GraphNode, ...]


def functional_graph(model: Any) -> Optional[FunctionalGraph]:
    """The graph `model.call` runs, deepest first; None unless Functional/Sequential `call`."""
    from keras.src.models.functional import Functional

    sequential = isinstance(model, keras.Sequential)
    functional = getattr(model, "_functional", None) if sequential else model
    own_call = keras.Sequential.call if sequential else Functional.call
    if not isinstance(functional, Functional) or type(model).call is not own_call:
        return None
    computed = {id(t) for t in functional.inputs}
    nodes = []
    for depth in sorted(functional._nodes_by_depth, reverse=True):
        for node in functional._nodes_by_depth[depth]:
            if node.operation is None or node.is_input or any(
                    id(t) not in computed for t in node.input_tensors):
                continue
            nodes.append(GraphNode(node.operation, tuple(node.input_tensors),
                                   tuple(node.outputs)))
            computed.update(id(t) for t in node.outputs)
    return FunctionalGraph(functional._inputs_struct, functional._outputs_struct, tuple(nodes))


def made_trainable(layer: Any) -> Iterable[Any]:
    """The variables `layer` made as trainable weights, also those frozen since (LoRA's base)."""
    return layer._trainable_variables


# ---- Training (MemFit): Keras's training loop and train step ----
_warned_version = False


def warn_if_untested_keras() -> None:
    """Warn once per process (logger "keras_memfit") when Keras is outside `TESTED_KERAS`."""
    global _warned_version
    version = keras_version()
    if _warned_version or not version:
        return
    low, high = TESTED_KERAS
    if not low <= version <= high:
        _warned_version = True
        logging.getLogger("keras_memfit").warning(
            "MemFit was tested with Keras %d.%d to %d.%d and reaches into "
            "Keras's training loop; Keras %s is outside that range.",
            *low, *high, keras.__version__,
        )


def call_has_training_arg(model: keras.Model) -> bool:
    """Whether `model.call` takes a `training` argument (`_call_has_training_arg`)."""
    return bool(model._call_has_training_arg)


def compute_loss(model: keras.Model, x: Any, y: Any, y_pred: Any, sample_weight: Any) -> Any:
    """The training loss of one batch, as Keras's train step computes it (`_compute_loss`)."""
    return model._compute_loss(
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
    )


def loss_tracker(model: keras.Model) -> Any:
    """The metric that tracks the mean loss in the logs (`_loss_tracker`)."""
    return model._loss_tracker


# ---- Nested structures ----


def assert_same_structure(a: Any, b: Any) -> None:
    """Raise ValueError (TypeError on some Keras) unless `a`, `b` nest alike; leaf types ignored."""
    keras.tree.assert_same_structure(a, b)  # Keras >= 3.8 (pyproject.toml) ignores leaf types


_UNTRACKED_SETATTR: dict = {}  # class -> whether Keras's __setattr__ only tracks, then object's


def set_function(obj: Any, name: str, function: Any) -> None:
    """`setattr`, skipping Keras's `__setattr__` where it only tracks (MemFit sets one per step)."""
    cls = type(obj)
    plain = _UNTRACKED_SETATTR.get(cls)
    if plain is None:
        Layer, Operation = layer_and_operation_classes()
        own = [c for c in cls.__mro__ if "__setattr__" in vars(c)]
        hook = getattr(cls, "_setattr_hook", None)
        plain = _UNTRACKED_SETATTR[cls] = (
            own == [Layer, object]
            and (hook is None or hook is getattr(Operation, "_setattr_hook", None))
        )
    (object.__setattr__ if plain else setattr)(obj, name, function)
