"""TensorFlow implementation of the backend seam (see `keras_memfit.backend`)."""

from __future__ import annotations

import os
import weakref
from typing import Any, Callable, Optional, Sequence, Tuple

import keras
import numpy as np
import tensorflow as tf

from keras_memfit._model_state import train_state_variables
from keras_memfit.backend.tensorflow.trainer import is_end_of_data, next_batches, step_function
from keras_memfit.backend.tensorflow.training import (
    CustomTrainStep,
    GradientAccumulator,
    TrainStep,
    has_default_train_step,
    make_accumulator,
    make_custom_train_step,
    make_train_step,
    uses_distribution,
)

# --------------------------------------------------------------------------
# OOM detection
# --------------------------------------------------------------------------
_INTERNAL_OOM_MESSAGES = (
    "Dst tensor is not initialized",
    "failed to allocate memory",
)


def is_oom_error(exc: BaseException) -> bool:
    """TensorFlow's own OOM forms: ResourceExhaustedError and two InternalErrors."""
    if isinstance(exc, tf.errors.ResourceExhaustedError):
        return True
    if isinstance(exc, tf.errors.InternalError):
        message = exc.message if isinstance(exc.message, str) else str(exc)
        lowered = message.lower()
        return any(m.lower() in lowered for m in _INTERNAL_OOM_MESSAGES)
    return False


def oom_error_bases() -> Tuple[type, ...]:
    """Bases for `OutOfMemoryError`, so existing `except` clauses still catch it."""
    return (tf.errors.ResourceExhaustedError,)


def init_oom_error(err: BaseException, message: str) -> None:
    tf.errors.ResourceExhaustedError.__init__(err, None, None, message)


# --------------------------------------------------------------------------
# Memory statistics
# --------------------------------------------------------------------------
def compute_device() -> str:
    """The device the model's computation runs on: the first GPU, else the CPU."""
    gpus = tf.config.list_logical_devices("GPU")
    return "GPU:0" if gpus else "CPU:0"


def memory_stats(device: str) -> Optional[Tuple[int, int]]:
    """(current, peak) bytes allocated by TensorFlow on `device`, or None."""
    try:
        info = tf.config.experimental.get_memory_info(device)
    except (ValueError, tf.errors.OpError):
        return None
    return int(info["current"]), int(info["peak"])


def memory_limit(device: str) -> Optional[Tuple[int, bool]]:
    """(bytes, exact) the allocator on `device` may use, or None when unknown.

    Known exactly for the capped CPU allocator (TF_CPU_ALLOCATOR_USE_BFC with
    TF_CPU_BFC_MEM_LIMIT_IN_MB) and for a GPU given a logical-device memory
    limit; from NVML (the optional `nvidia-ml-py`) for a whole GPU, as the
    device's memory less what other processes use, less 5% that TensorFlow
    keeps in reserve. `exact` says whether the planner may trust it before a
    first OOM; all three are trusted.
    """
    mib = 1 << 20
    if device.upper().startswith("CPU"):
        if os.environ.get("TF_CPU_ALLOCATOR_USE_BFC", "").lower() not in ("1", "true"):
            return None
        limit = os.environ.get("TF_CPU_BFC_MEM_LIMIT_IN_MB", "")
        return (int(limit) * mib, True) if limit.isdigit() else None
    index = int(device.rsplit(":", 1)[-1]) if ":" in device else 0
    physical = tf.config.list_physical_devices("GPU")
    if index < len(physical):
        try:
            configs = tf.config.get_logical_device_configuration(physical[index])
        except (ValueError, RuntimeError):
            configs = None
        if configs and getattr(configs[0], "memory_limit", None):
            return int(configs[0].memory_limit) * mib, True
    return _nvml_limit(index)


def _nvml_limit(index: int) -> Optional[Tuple[int, bool]]:
    try:
        import pynvml  # provided by the optional `nvidia-ml-py`
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        total = pynvml.nvmlDeviceGetMemoryInfo(handle).total
        others = 0
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid != os.getpid() and proc.usedGpuMemory:
                others += proc.usedGpuMemory
        # TensorFlow leaves a small reserve; 5% keeps the estimate conservative.
        return int((total - others) * 0.95), True
    except Exception:  # NVML missing, no permission, MIG, ...: treat as unknown
        return None


# --------------------------------------------------------------------------
# Compiled steps
# --------------------------------------------------------------------------
def _compile(model: keras.Model, fn: Callable, static_shapes: bool = False) -> Callable:
    """`fn` compiled as Keras would compile the model's own steps.

    The step functions below reach the model through a weak reference, so
    that caching a compiled step per model (`keras_memfit._cache`) does not
    keep the model alive. `static_shapes` traces once per piece size instead
    of relaxing the batch dimension to unknown (see `_needs_static_batch`).
    """
    if getattr(model, "run_eagerly", False):
        return fn
    return tf.function(
        fn, reduce_retracing=not static_shapes, jit_compile=bool(model.jit_compile)
    )


def _needs_static_batch(model: keras.Model) -> bool:
    """Whether a step that splits batches must be traced with a static batch size.

    Keras weights each per-output loss tracker (multi-output models) by the
    *static* batch size of the outputs; in a step traced with an unknown batch
    dimension every piece would count as one sample, so pieces of different
    sizes would skew the per-output losses.
    """
    compile_loss = getattr(model, "_compile_loss", None)
    return bool(getattr(compile_loss, "metrics", None))


def make_predict_step(
    model: keras.Model, postprocess: Optional[Callable] = None
) -> Callable:
    """A compiled `x -> outputs` running `model.predict_step` then `postprocess`."""
    model_ref = weakref.ref(model)

    def predict_step(x):
        outputs = model_ref().predict_step((x,))
        if postprocess is not None:
            outputs = postprocess(outputs)
        return outputs

    return _compile(model, predict_step)


def make_test_step(model: keras.Model) -> Callable:
    """A compiled `(x, y, sample_weight) -> logs` step running `model.test_step`."""
    model_ref = weakref.ref(model)

    def test_step(data):
        return model_ref().test_step(data)

    return _compile(model, test_step, static_shapes=_needs_static_batch(model))


class VariableGuard:
    """Copies of some variables, taken before a step and restored if it fails.

    The copies live on the variables' own devices and are taken by one small
    compiled function, so a snapshot costs one dispatch, not a host round trip.
    Take the snapshot *before* each attempt: a step that fails may have
    updated some of the variables, or none.
    """

    def __init__(self, variables: Sequence[Any]) -> None:
        self._variables = list(variables)
        self._shadows = []
        for v in self._variables:
            with tf.device(v.value.device):
                self._shadows.append(tf.Variable(v.value, trainable=False))
        pairs = list(zip(self._shadows, self._variables))

        @tf.function
        def snapshot():
            for shadow, v in pairs:
                shadow.assign(v.value)

        self._snapshot = snapshot if pairs else None

    def snapshot(self) -> None:
        """Record the variables' current values."""
        if self._snapshot is not None:
            self._snapshot()

    def restore(self) -> None:
        """Put back the values recorded by the last `snapshot()`."""
        for shadow, v in zip(self._shadows, self._variables):
            v.assign(shadow)


def guard_variables(variables: Sequence[Any]) -> VariableGuard:
    """A `VariableGuard` over `variables` (see its docstring)."""
    return VariableGuard(variables)


def prepare_test(model: keras.Model, batch: Any) -> None:
    """Build the model, its compiled metrics and loss before steps are traced."""
    x, y, sample_weight = batch
    model._symbolic_build(data_batch=(x, y, sample_weight))


def output_spec(step: Callable, x: Any) -> Optional[Any]:
    """Output structure of `step(x)` by tracing only; `NO_SPEC` for eager steps.

    Each tensor leaf becomes a `keras_memfit.backend.Spec` with `None` for unknown
    dimensions (the batch dimension is traced as unknown, so the same trace
    then serves every batch size and the step is traced once); a leaf that is
    not a tensor is returned as it is.
    """
    polymorphic = tf.types.experimental.PolymorphicFunction
    if not isinstance(step, polymorphic):
        step = getattr(step, "__wrapped__", None)  # a functools.wraps wrapper
        if not isinstance(step, polymorphic):
            from keras_memfit.backend import NO_SPEC
            return NO_SPEC
    spec = keras.tree.map_structure(
        lambda a: tf.TensorSpec((None,) + tuple(a.shape[1:]), tf.as_dtype(a.dtype)), x
    )
    outputs = step.get_concrete_function(spec).structured_outputs

    from keras_memfit.backend import Spec

    def describe(leaf):
        if not tf.is_tensor(leaf):
            return leaf
        shape = tuple(leaf.shape.as_list()) if leaf.shape.rank is not None else None
        return Spec(shape, np.dtype(leaf.dtype.as_numpy_dtype))

    return keras.tree.map_structure(describe, outputs)



def reset_peak(device: str) -> None:
    """Start a new peak measurement on `device` (no-op where unsupported)."""
    try:
        tf.config.experimental.reset_memory_stats(device)
    except (ValueError, tf.errors.OpError):
        pass


# ---- placement ----
# Device code for `keras_memfit.place`: naming devices, moving a variable,
# making optimizer slots and updates follow their variable.
_HOST = "/CPU:0"


def host_device() -> str:
    """The host device that pinned layers live on."""
    return _HOST


def list_accelerators() -> list:
    """Canonical names ("/GPU:0", ...) of the logical GPUs TensorFlow sees."""
    return [canonical_device(d.name) for d in tf.config.list_logical_devices("GPU")]


def canonical_device(name: str) -> Optional[str]:
    """`name` as "/TYPE:index" ("/device:GPU:0" -> "/GPU:0"), or None if unparsable."""
    try:
        spec = tf.DeviceSpec.from_string(name)
    except (ValueError, TypeError):
        return None
    if not spec.device_type:
        return None
    return f"/{spec.device_type.upper()}:{spec.device_index or 0}"


def device_exists(name: str) -> bool:
    """Whether `name` (canonical) is one of TensorFlow's logical devices."""
    return any(canonical_device(d.name) == name for d in tf.config.list_logical_devices())


def device_scope(device: str):
    """A context manager placing ops and new variables on `device`."""
    return tf.device(device)


def variable_device(variable: Any) -> Optional[str]:
    """Canonical device of a Keras (or tf) variable; None if not created yet."""
    value = variable._value if isinstance(variable, keras.Variable) else variable
    if value is None:
        return None
    return canonical_device(value.device)


def move_variable(variable: Any, device: str) -> bool:
    """Recreate a built `keras.Variable`'s storage on `device`, keeping its value.

    The Keras variable object stays the same (layers, the optimizer and
    trackers hold it); only the `tf.Variable` inside is replaced. Functions
    traced before the move still hold the old one: reset them.

    Returns:
        Whether the variable was moved (False when it was already there or
        is not created yet).
    """
    old = getattr(variable, "_value", None)
    if old is None or canonical_device(old.device) == device:
        return False
    with tf.init_scope(), tf.device(device):
        new = tf.Variable(
            old.read_value(),
            dtype=old.dtype,
            trainable=old.trainable,
            name=old.name.split(":")[0],
            aggregation=old.aggregation,
            synchronization=old.synchronization,
        )
    variable._value = new
    return True



def follow_variable_devices(optimizer: Any) -> None:
    """Make `optimizer` create each slot, and run each update, on its variable's device.

    Keras creates slots on the current default device (on a GPU machine, the
    GPU) whatever device their variable lives on; this wraps the optimizer's
    `add_variable_from_reference` and `update_step` (instance attributes, once).
    """
    if optimizer is None or getattr(optimizer, "_memfit_follows_devices", False):
        return
    add_from_reference = optimizer.add_variable_from_reference
    update_step = optimizer.update_step

    def add_variable_from_reference(reference_variable, *args, **kwargs):
        device = variable_device(reference_variable)
        if device is None:
            return add_from_reference(reference_variable, *args, **kwargs)
        with tf.init_scope(), tf.device(device):
            slot = add_from_reference(reference_variable, *args, **kwargs)
            if isinstance(slot, keras.Variable):
                move_variable(slot, device)  # in case the scope was lost
        return slot

    def update_step_on_device(gradient, variable, *args, **kwargs):
        device = variable_device(variable)
        if device is None:
            return update_step(gradient, variable, *args, **kwargs)
        with tf.device(device):
            return update_step(gradient, variable, *args, **kwargs)

    # Bypass Keras's attribute tracking: these are plain functions.
    object.__setattr__(optimizer, "add_variable_from_reference", add_variable_from_reference)
    object.__setattr__(optimizer, "update_step", update_step_on_device)
    object.__setattr__(optimizer, "_memfit_follows_devices", True)

def creating_on(device: str, add_weight: Callable) -> Callable:
    """`add_weight` creating its variable on `device`, even while a function is traced.

    A variable created while tracing is lifted out of the graph into eager
    mode, where the surrounding `tf.device` scope is lost, so the scope is
    re-entered inside `tf.init_scope`.
    """

    def add_weight_on_device(*args, **kwargs):
        with tf.init_scope(), tf.device(device):
            variable = add_weight(*args, **kwargs)
        if not isinstance(variable, keras.Variable):
            return variable
        if variable._value is None:  # deferred (symbolic build): created later
            initialize = variable._deferred_initialize

            def deferred_initialize():
                with tf.init_scope(), tf.device(device):
                    initialize()

            object.__setattr__(variable, "_deferred_initialize", deferred_initialize)
        else:  # created, not read yet: safe to move
            with tf.init_scope():
                move_variable(variable, device)
        return variable

    add_weight_on_device.__wrapped__ = add_weight
    return add_weight_on_device


def call_on_device(device: str, call: Callable) -> Callable:
    """`call` whose ops run on `device`, its gradients included.

    A `tf.device` scope around the forward pass does not reach its gradient
    ops, which `GradientTape` creates later under whatever scope is active
    (on a GPU machine, the GPU): the kernel gradient of a pinned Dense would
    be computed there and cross back. The call is therefore wrapped in a
    `tf.custom_gradient` whose backward pass runs under the same scope; an
    embedding keeps its sparse (IndexedSlices) gradient.
    """

    def call_here(*args, **kwargs):
        flat = tf.nest.flatten((args, kwargs))
        inputs = [i for i, t in enumerate(flat)
                  if tf.is_tensor(t) and not isinstance(t, tf.SparseTensor)
                  and t.dtype.is_floating]

        @tf.custom_gradient
        def forward(*xs):
            leaves = list(flat)
            for i, x in zip(inputs, xs):
                leaves[i] = x
            a, k = tf.nest.pack_sequence_as((args, kwargs), leaves)
            with tf.device(device), tf.GradientTape() as tape:
                tape.watch(xs)
                out = call(*a, **k)

            def backward(*upstream, variables=None):
                variables = list(variables or [])
                with tf.device(device):
                    grads = tape.gradient(
                        out, list(xs) + variables,
                        output_gradients=tf.nest.pack_sequence_as(out, list(upstream)),
                    )
                return grads[: len(xs)], grads[len(xs):]

            return out, backward

        return forward(*[flat[i] for i in inputs])

    return call_here


def probe_inputs(model: keras.Model) -> Tuple[Any, bool]:
    """Zeros, one sample, in the structure `model` is called with: (inputs, positional).

    The structure is the one `trace_layer_calls` uses (a functional or
    Sequential model's `Input`s, a dict or list of them included; a
    subclassed model's build shapes, dicts and lists included). Unknown
    dimensions are 1. Call `model(inputs)` when `positional`, else
    `model(**inputs)`.

    Raises:
        ValueError: If the model has not been built.
    """
    spec, positional = _model_input_specs(model)

    def zeros(s):
        shape = (1,) + tuple(1 if d is None else int(d) for d in s.shape[1:])
        return tf.zeros(shape, dtype=s.dtype)

    return keras.tree.map_structure(zeros, spec), positional


# ---- memory report ----
def _model_input_specs(model: keras.Model) -> Tuple[Any, bool]:
    """(structure of `tf.TensorSpec`s, positional) to call `model` symbolically with.

    Functional and Sequential models give their `Input`s; other models the
    shapes they were built with (`_build_shapes_dict`, float32, or the model's
    `input_dtype`). The batch dimension is always unknown.
    """
    struct = None
    functional = getattr(model, "_functional", None)  # Sequential
    for source in (model, functional):
        struct = getattr(source, "_inputs_struct", None) if source is not None else None
        if struct is not None:
            break
    if struct is not None:
        spec = keras.tree.map_structure(
            lambda t: tf.TensorSpec((None,) + tuple(t.shape[1:]), tf.as_dtype(t.dtype)), struct
        )
        return spec, True
    shapes = getattr(model, "_build_shapes_dict", None)
    if not model.built or not shapes:
        raise ValueError(
            f"the model {model.name!r} has not been built, so its layers' shapes are "
            "unknown; received an unbuilt model. Build it first, as `model.summary()` "
            "needs too: call it on a batch, call `model.build(input_shape)`, or give a "
            "Sequential model a `keras.Input(shape)` first layer."
        )
    dtype = tf.as_dtype(getattr(model, "input_dtype", None) or "float32")

    def to_spec(shape):
        return tf.TensorSpec((None,) + tuple(shape[1:]), dtype)

    def specs(shape):  # a shape, or a dict/list of them
        if isinstance(shape, dict):
            return {k: specs(v) for k, v in shape.items()}
        if isinstance(shape, (tuple, list)) and shape and not all(
            d is None or isinstance(d, int) for d in shape
        ):
            return type(shape)(specs(v) for v in shape)
        return to_spec(shape)

    if len(shapes) == 1:
        (shape,) = shapes.values()
        return specs(shape), True
    return {k.removesuffix("_shape"): specs(s) for k, s in shapes.items()}, False


def _tensor_info(value: Any) -> Optional[Tuple[str, Tuple[Optional[int], ...], str]]:
    if not isinstance(value, tf.Tensor) or not hasattr(value, "graph"):
        return None
    shape = tuple(value.shape.as_list()) if value.shape.rank is not None else (None,)
    return value.name, shape, value.dtype.name


def trace_layer_calls(model: keras.Model) -> dict:
    """Every layer and operation call of one symbolic forward pass of `model`.

    Calls `model(inputs, training=False)` inside a throw-away `tf.function`
    trace (nothing runs, nothing is allocated) and a `keras.StatelessScope`
    (no variable changes, no losses recorded), with `Layer.__call__` and
    `Operation.__call__` temporarily wrapped to record each call; both are
    restored before returning.

    Args:
        model: A built Keras model.

    Returns:
        A dict with `inputs` (list of tensor infos: `(key, shape, dtype)` where
        `key` identifies the tensor and `shape` includes the batch dimension
        as None), `outputs` (keys of the model's outputs) and `calls`: one dict
        per call in call order with `op` (the layer or operation), `depth`
        (1 for the model's direct children), `parent` (index of the enclosing
        call, None at depth 1), `inputs` and `outputs` (tensor infos).

    Raises:
        ValueError: If the model has not been built.
    """
    from keras.src.layers.layer import Layer
    from keras.src.ops.operation import Operation

    spec, positional = _model_input_specs(model)
    flat_spec = keras.tree.flatten(spec)
    records: list = []
    stack: list = []
    result: dict = {}
    layer_call, op_call = Layer.__call__, Operation.__call__

    def record(op, original, args, kwargs):
        index = len(records)
        entry = {
            "op": op,
            "depth": len(stack),
            "parent": stack[-1] if stack else None,
            "inputs": [
                info for info in map(_tensor_info, keras.tree.flatten((args, kwargs)))
                if info is not None
            ],
            "outputs": [],
        }
        records.append(entry)
        stack.append(index)
        try:
            outputs = original(op, *args, **kwargs)
        finally:
            stack.pop()
        infos = [_tensor_info(t) for t in keras.tree.flatten(outputs)]
        entry["outputs"] = [info for info in infos if info is not None]
        return outputs

    def patched_layer_call(self, *args, **kwargs):
        return record(self, layer_call, args, kwargs)

    def patched_op_call(self, *args, **kwargs):
        if isinstance(self, Layer):  # already recorded by Layer.__call__
            return op_call(self, *args, **kwargs)
        return record(self, op_call, args, kwargs)

    def forward(*flat):
        inputs = keras.tree.pack_sequence_as(spec, flat)
        result["inputs"] = [_tensor_info(t) for t in flat]
        with keras.StatelessScope():
            if positional:
                outputs = model(inputs, training=False)
            else:
                outputs = model(**inputs, training=False)
        result["outputs"] = [
            info[0] for info in map(_tensor_info, keras.tree.flatten(outputs)) if info
        ]
        return outputs

    Layer.__call__, Operation.__call__ = patched_layer_call, patched_op_call
    try:
        tf.function(forward, autograph=False).get_concrete_function(*flat_spec)
    finally:
        Layer.__call__, Operation.__call__ = layer_call, op_call
    # The model's own call is depth 0: keep its descendants, one level up.
    calls = []
    remap = {}
    for index, entry in enumerate(records):
        if entry["depth"] == 0:
            continue
        remap[index] = len(calls)
        entry = dict(entry)
        entry["parent"] = remap.get(entry["parent"])
        calls.append(entry)
    result["calls"] = calls
    return result
