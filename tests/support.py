"""Shared test support: small models, data, a recorder callback, a PyDataset, comparisons.

Import it from a test module (`from support import dense_model, ...`); pytest
puts `tests/` on `sys.path`. Fixtures live in conftest.py; this module holds
plain functions and classes, and the one helper that swaps what the backend's
factories build (`wrap_factory`), which the fault-injecting fixtures share.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import keras
import numpy as np
import pytest

RTOL, ATOL = 1e-5, 1e-6
REF_BATCH = 16  # the batch size of the `reference` predictions


# ---------------------------------------------------------------------------
# The active backend: its errors and its keras_memfit package
# ---------------------------------------------------------------------------
BACKEND = keras.backend.backend()  # the suite runs under KERAS_BACKEND (tensorflow, jax, torch)

# Tests that exercise TensorFlow itself (its capped BFC allocator, tf.function
# steps, tf.distribute, place): skipped with this reason under another backend.
# `@pytest.mark.tensorflow(reason="...")` says why in the skip message.
requires_tensorflow = pytest.mark.tensorflow
# Keras's torch trainer raises ValueError for steps_per_execution > 1.
multi_step_execution = pytest.mark.not_on_torch(
    reason="steps_per_execution > 1: Keras's torch trainer refuses it (ValueError)"
)
# Keras's torch backend has no sparse tensors (`sparse=True` is a ValueError there).
no_torch_sparse = pytest.mark.not_on_torch(
    reason="sparse inputs: Keras's torch backend has none (`sparse=True` is refused)"
)
# Plain Keras's own fit of a stateful LSTM fails on torch (3.15.1: "one of the
# variables needed for gradient computation has been modified by an inplace
# operation"), so there is no reference to compare MemFit's fit with.
keras_trains_stateful_rnns = pytest.mark.not_on_torch(
    reason="plain Keras's fit of a stateful LSTM fails on torch (an in-place state update "
    "breaks autograd): no reference to compare with"
)
# Keras's torch backend infers a layer's output shape by calling it eagerly on 83 rows.
torch_infers_shapes_by_calling = pytest.mark.not_on_torch(
    reason="Keras's torch backend infers a layer's output shape by calling it on 83 rows, "
    "which this test's layer refuses while the model is built"
)
# Keras on JAX itself has no string or ragged tensors (what Keras's own
# predict/evaluate take there is what these conformance tests compare with).
keras_tensorflow_inputs = pytest.mark.tensorflow(
    reason="string and ragged tensors: Keras itself takes them only on TensorFlow"
)


def memory_report_unsupported() -> Optional[str]:
    """None where `memory_report` works on the active backend, else why not.

    The backend's own `NotImplementedError` message (the model analysis is
    built backend by backend), found by reporting a one-layer model.
    """
    from keras_memfit import memory_report

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    try:
        memory_report(model, 1)
    except NotImplementedError as err:
        return str(err)
    return None


def requires_memory_report() -> Any:
    """A skip marker for tests of `memory_report` where the active backend lacks it."""
    why = memory_report_unsupported()
    return pytest.mark.skipif(
        why is not None, reason=f"memory_report on {BACKEND}: {why}"
    )


def backend_module() -> Any:
    """keras_memfit's package for the active backend (`keras_memfit.backend.get()`)."""
    from keras_memfit import backend

    return backend.get()


def oom_error_class() -> type:
    """The class of the active backend's real OOM errors.

    TensorFlow: `tf.errors.ResourceExhaustedError`; JAX:
    `jax.errors.JaxRuntimeError` (a `RESOURCE_EXHAUSTED` status); torch:
    `torch.OutOfMemoryError`.
    """
    if BACKEND == "torch":
        import torch

        return torch.OutOfMemoryError
    if BACKEND == "jax":
        import jax

        return jax.errors.JaxRuntimeError
    import tensorflow as tf

    return tf.errors.ResourceExhaustedError


def oom_error(rows: Any = "N") -> BaseException:
    """A real OOM exception object of the active backend, as its allocator raises it.

    TensorFlow: `ResourceExhaustedError("OOM when allocating tensor ...")`;
    JAX: `JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating N
    bytes.")`, the form XLA's CPU and GPU clients raise; torch:
    `torch.OutOfMemoryError("CUDA out of memory. Tried to allocate ...")`, the
    form CUDA's caching allocator raises.

    Example:
        >>> raise oom_error(64)
    """
    if BACKEND == "torch":
        import torch

        size = rows * 4096 if isinstance(rows, int) else 4096
        return torch.OutOfMemoryError(
            f"CUDA out of memory. Tried to allocate {size} bytes. (injected, {rows} rows)"
        )
    if BACKEND == "jax":
        import jax

        size = rows * 4096 if isinstance(rows, int) else 4096
        return jax.errors.JaxRuntimeError(
            f"RESOURCE_EXHAUSTED: Out of memory allocating {size} bytes. (injected, {rows} rows)"
        )
    import tensorflow as tf

    return tf.errors.ResourceExhaustedError(
        None, None, f"OOM when allocating tensor with shape[{rows},...] (injected)"
    )


def runtime_error(message: str, status: str = "INVALID_ARGUMENT") -> BaseException:
    """A runtime error of the active backend that is NOT an OOM (bad input, say).

    Args:
        message: The error's message.
        status: "INVALID_ARGUMENT" or "INTERNAL".

    Returns:
        TensorFlow: `tf.errors.InvalidArgumentError` (or `InternalError`); JAX:
        `JaxRuntimeError` with that XLA status; torch: a plain `RuntimeError`
        (as torch raises its runtime failures).
    """
    if BACKEND == "torch":
        return RuntimeError(f"{status}: {message}")
    if BACKEND == "jax":
        import jax

        return jax.errors.JaxRuntimeError(f"{status}: {message}")
    import tensorflow as tf

    cls = {"INVALID_ARGUMENT": tf.errors.InvalidArgumentError,
           "INTERNAL": tf.errors.InternalError}[status]
    return cls(None, None, message)


# How the backend names the host device in keras_memfit's messages.
HOST_DEVICE = {"jax": "cpu:0", "torch": "cpu:0"}.get(BACKEND, "CPU:0")


# ---------------------------------------------------------------------------
# Swapping what the backend builds (fault injection)
# ---------------------------------------------------------------------------
def wrap_factory(monkeypatch: Any, factory: str, wrap: Callable[[Any], Any]) -> None:
    """Make the active backend's `factory` return `wrap(built)` instead of `built`.

    For the rest of the test, every step (or guard) keras_memfit has the
    backend build goes through `wrap`, e.g. `wrap_factory(monkeypatch,
    "make_predict_step", lambda step: failing_version_of(step))`. A function
    `wrap` returns gets `__wrapped__` set to the real step (unless it has
    one), so that `backend.output_spec` still traces the real step. Steps
    compiled before (cached per model) would bypass the wrapper, so the step
    cache is cleared.

    Args:
        monkeypatch: pytest's `monkeypatch`; the factory is restored at teardown.
        factory: The backend function's name: "make_predict_step",
            "make_test_step", "guard_variables", ...
        wrap: Called with each object the factory builds; returns what
            keras_memfit gets instead.
    """
    from keras_memfit._internal import cache as _cache
    from keras_memfit import backend

    module = backend.get()
    make = getattr(module, factory)

    def patched(*args: Any, **kwargs: Any) -> Any:
        built = make(*args, **kwargs)
        result = wrap(built)
        if inspect.isfunction(result) and result is not built and not hasattr(
            result, "__wrapped__"
        ):
            result.__wrapped__ = built
        return result

    monkeypatch.setattr(module, factory, patched)
    _cache.clear()


def rows_of(data: Any) -> int:
    """The number of rows of a batch structure (its first non-None leaf's length)."""
    return next(int(leaf.shape[0]) for leaf in keras.tree.flatten(data) if leaf is not None)


# ---------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------
def dense_model(in_dim: int = 4, out_dim: int = 3, seed: int = 0, name: Optional[str] = None):
    """Dense(8, relu) then Dense(out_dim), uncompiled; the same weights for the same seed."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((in_dim,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    outputs = keras.layers.Dense(out_dim)(hidden)
    return keras.Model(inputs, outputs, name=name)


def identity_model(dim: int = 2):
    """Outputs its input exactly: row i of the output is row i of the input."""
    inputs = keras.Input((dim,))
    outputs = keras.layers.Dense(
        dim, kernel_initializer="identity", bias_initializer="zeros"
    )(inputs)
    return keras.Model(inputs, outputs)


def two_input_model(as_dict: bool):
    """Inputs "a" (4 features) and "b" (2), as a dict or a list; 3 outputs."""
    keras.utils.set_random_seed(3)
    a = keras.Input((4,), name="a")
    b = keras.Input((2,), name="b")
    h = keras.layers.Concatenate()([keras.layers.Dense(5)(a), keras.layers.Dense(5)(b)])
    out = keras.layers.Dense(3)(h)
    return keras.Model({"a": a, "b": b} if as_dict else [a, b], out)


def multi_output_model(as_dict: bool):
    """Outputs "probs" (5, softmax) and "value" (1), as a dict or a list."""
    keras.utils.set_random_seed(4)
    inputs = keras.Input((4,))
    h = keras.layers.Dense(6, activation="tanh")(inputs)
    probs = keras.layers.Dense(5, activation="softmax", name="probs")(h)
    value = keras.layers.Dense(1, name="value")(h)
    outputs = {"probs": probs, "value": value} if as_dict else [probs, value]
    return keras.Model(inputs, outputs)


# ---------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------
def rows_data(n: int, dim: int = 2) -> np.ndarray:
    """Row i is (i, -i, ...): every row is recognisable by its first column."""
    x = np.zeros((n, dim), "float32")
    x[:, 0] = np.arange(n)
    if dim > 1:
        x[:, 1] = -np.arange(n)
    return x


def random_data(n: int, dim: int = 4, seed: int = 1) -> np.ndarray:
    """`n` rows of standard normal float32 features."""
    return np.random.default_rng(seed).normal(size=(n, dim)).astype("float32")


def batches(x: Any, sizes: Sequence[int]) -> Iterator[Tuple[Any]]:
    """A generator of `(x_batch,)` tuples (the form Keras requires) of the given sizes."""
    start = 0
    for size in sizes:
        yield (x[start:start + size],)
        start += size


class Batches(keras.utils.PyDataset):
    """A PyDataset of consecutive batches of `x` (and `y`, when given).

    Batch `i` is `x[i*batch_size:(i+1)*batch_size]`, or the pair of that and
    the same rows of `y`; the last batch may be shorter.
    """

    def __init__(self, x: Any, y: Any = None, batch_size: int = 32) -> None:
        super().__init__()
        self.x, self.y, self.batch_size = x, y, batch_size

    def __len__(self) -> int:
        return -(-len(self.x) // self.batch_size)

    def __getitem__(self, index: int) -> Any:
        rows = slice(index * self.batch_size, (index + 1) * self.batch_size)
        if self.y is None:
            return self.x[rows]
        return self.x[rows], self.y[rows]


# ---------------------------------------------------------------------------
# References and comparisons
# ---------------------------------------------------------------------------
def reference(model: keras.Model, x: Any, **kwargs: Any) -> Any:
    """`model.predict` itself, in small batches: the independent reference."""
    if _is_arrays(x):
        kwargs.setdefault("batch_size", REF_BATCH)
    return model.predict(x, verbose=0, **kwargs)


def _is_arrays(x: Any) -> bool:
    leaves = keras.tree.flatten(x)
    return all(isinstance(a, np.ndarray) or keras.ops.is_tensor(a) for a in leaves)


def assert_same_result(result: Any, expected: Any) -> None:
    """Same structure (container types included), dtypes, shapes and values."""
    assert type(result) is type(expected), (type(result), type(expected))
    keras.tree.assert_same_structure(result, expected)
    if isinstance(expected, dict):
        assert list(result) == list(expected) or set(result) == set(expected)
    for got, want in zip(keras.tree.flatten(result), keras.tree.flatten(expected)):
        assert isinstance(got, np.ndarray), type(got)
        assert got.dtype == want.dtype, (got.dtype, want.dtype)
        assert got.shape == want.shape, (got.shape, want.shape)
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


# ---------------------------------------------------------------------------
# Callbacks
# ---------------------------------------------------------------------------
class Recorder(keras.callbacks.Callback):
    """Records every predict/test/train callback call, in order.

    `events` holds `(hook, batch, logs)`: the hook's name without `on_`
    ("predict_begin", "test_batch_end", ...), the batch (or epoch) index or
    None, and a shallow copy of the logs (None when Keras passed none).
    """

    def __init__(self) -> None:
        super().__init__()
        self.events: List[Tuple[str, Optional[int], Any]] = []

    def of(self, hook: str) -> List[Tuple[Optional[int], Any]]:
        """`(batch, logs)` of each call of `hook` ("predict_batch_end", ...), in order."""
        return [(batch, logs) for name, batch, logs in self.events if name == hook]

    def hooks(self) -> List[str]:
        """The hook of each call, in order."""
        return [name for name, _, _ in self.events]

    def _record(self, hook: str, batch: Optional[int], logs: Any) -> None:
        self.events.append((hook, batch, dict(logs) if isinstance(logs, dict) else logs))

    def on_predict_begin(self, logs=None):
        self._record("predict_begin", None, logs)

    def on_predict_batch_begin(self, batch, logs=None):
        self._record("predict_batch_begin", batch, logs)

    def on_predict_batch_end(self, batch, logs=None):
        self._record("predict_batch_end", batch, logs)

    def on_predict_end(self, logs=None):
        self._record("predict_end", None, logs)

    def on_test_begin(self, logs=None):
        self._record("test_begin", None, logs)

    def on_test_batch_begin(self, batch, logs=None):
        self._record("test_batch_begin", batch, logs)

    def on_test_batch_end(self, batch, logs=None):
        self._record("test_batch_end", batch, logs)

    def on_test_end(self, logs=None):
        self._record("test_end", None, logs)

    def on_train_begin(self, logs=None):
        self._record("train_begin", None, logs)

    def on_epoch_begin(self, epoch, logs=None):
        self._record("epoch_begin", epoch, logs)

    def on_train_batch_begin(self, batch, logs=None):
        self._record("train_batch_begin", batch, logs)

    def on_train_batch_end(self, batch, logs=None):
        self._record("train_batch_end", batch, logs)

    def on_epoch_end(self, epoch, logs=None):
        self._record("epoch_end", epoch, logs)

    def on_train_end(self, logs=None):
        self._record("train_end", None, logs)


def assert_same_training(model, history, reference, expected, iterations):
    """`model` trained as `reference`: `iterations` optimizer steps each, History
    `history` equal to `expected`, the same weights and optimizer variables.

    Backend-neutral (the JAX and torch children use it: tests/jax_support.py,
    tests/torch_support.py).
    """
    def steps(m):
        return int(keras.ops.convert_to_numpy(m.optimizer.iterations.value))

    assert steps(model) == steps(reference) == iterations
    for name, values in expected.items():
        np.testing.assert_allclose(history[name], values, rtol=1e-5, err_msg=name)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(model.optimizer.variables, reference.optimizer.variables):
        np.testing.assert_allclose(keras.ops.convert_to_numpy(a.value),
                                   keras.ops.convert_to_numpy(b.value), rtol=1e-5, atol=1e-6)


def requires_keras(minimum, why):
    """Skip a conformance test where the installed Keras is older than `minimum`.

    The conformance tests compare keras_memfit with the installed Keras's own
    call. Where an older Keras behaves differently itself (a missing feature,
    a behaviour later fixed), the comparison says nothing about keras_memfit,
    so the test is skipped there with `why`, never silently passed.
    """
    import keras
    from keras_memfit._internal.keras_compat import keras_version

    return pytest.mark.skipif(
        keras_version() < tuple(minimum),
        reason=f"Keras {keras.__version__} < {'.'.join(map(str, minimum))}: {why}",
    )


class _AddOptional(keras.layers.Layer):
    def call(self, a, o=None):
        return a * 2.0 if o is None else a + o


def optional_input_model(loss: Optional[str] = None) -> keras.Model:
    """A model with inputs {"a", "o"}, "o" optional: `a * 2` without it, `a + o` with it.

    Compiled with `loss` when one is given (for evaluate).
    """
    a = keras.Input((2,), name="a")
    o = keras.Input((2,), name="o", optional=True)
    model = keras.Model({"a": a, "o": o}, _AddOptional()(a, o))
    if loss is not None:
        model.compile(loss=loss)
    return model


class CustomStepModel(keras.Sequential):
    """Overrides train_step (the same computation): MemFit cannot split it into
    micro-batches, so it trains as shrink."""

    if BACKEND == "jax":  # JAX's train_step is functional: (state, data) -> (logs, state)
        def train_step(self, state, data):
            return super().train_step(state, data)
    else:
        def train_step(self, data):
            return super().train_step(data)


# The drop-in conformance tests (predict and evaluate) that compare with a
# Keras whose own behaviour differs before 3.13.
KERAS_DROPIN_SINCE_3_13 = requires_keras(
    (3, 13),
    "Keras's own predict/evaluate differs here before 3.13 (measured on 3.8.0: tensors instead "
    "of numpy for bool/int/string/sparse outputs, no keras.Input(ragged=True), optional None "
    "inputs rejected by its data adapter, batch_end index 0 with steps_per_execution; passes "
    "on 3.13.2 and 3.15.1)",
)
