"""TensorFlow implementation of the backend seam (see `keras_memfit.backend`)."""

from __future__ import annotations

import os
from typing import Any, Callable, Optional, Sequence, Tuple

import keras
import numpy as np
import tensorflow as tf

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
def _compile(model: keras.Model, fn: Callable) -> Callable:
    if getattr(model, "run_eagerly", False):
        return fn
    return tf.function(fn, reduce_retracing=True, jit_compile=bool(model.jit_compile))


def make_predict_step(
    model: keras.Model, postprocess: Optional[Callable] = None
) -> Callable:
    """A compiled `x -> outputs` running `model.predict_step` then `postprocess`."""

    def predict_step(x):
        outputs = model.predict_step((x,))
        if postprocess is not None:
            outputs = postprocess(outputs)
        return outputs

    return _compile(model, predict_step)


def make_test_step(model: keras.Model) -> Callable:
    """A compiled `(x, y, sample_weight) -> logs` step running `model.test_step`."""
    return _compile(model, model.test_step)


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


def to_numpy(value: Any) -> np.ndarray:
    """Copy a backend tensor to host memory."""
    return keras.ops.convert_to_numpy(value)


def reset_peak(device: str) -> None:
    """Start a new peak measurement on `device` (no-op where unsupported)."""
    try:
        tf.config.experimental.reset_memory_stats(device)
    except (ValueError, tf.errors.OpError):
        pass
