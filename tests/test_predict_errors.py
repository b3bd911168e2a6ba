"""`safe_predict`'s errors: invalid arguments (before any step runs), errors that are not OOMs
(propagated untouched), and a single sample that does not fit (`OutOfMemoryError`).
"""

from __future__ import annotations

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_memfit import OutOfMemoryError, safe_predict
from support import (
    torch_infers_shapes_by_calling,
    Batches,
    HOST_DEVICE,
    assert_same_result,
    batches,
    dense_model,
    oom_error_class,
    random_data,
    reference,
    rows_of,
    runtime_error,
    two_input_model,
    wrap_factory,
)


@pytest.fixture
def raising_step(monkeypatch):
    """`raising_step(exc, above)`: predict steps raise `exc` itself above `above` rows.

    Returns a dict whose "calls" lists the rows of every call.
    """
    state = {"exc": None, "above": 0, "calls": []}

    def wrap(real):
        def step(x):
            rows = rows_of(x)
            state["calls"].append(rows)
            if rows > state["above"]:
                raise state["exc"]
            return real(x)

        return step

    wrap_factory(monkeypatch, "make_predict_step", wrap)

    def configure(exc, above=0):
        state["exc"], state["above"] = exc, above
        return state

    return configure


# ---------------------------------------------------------------------------
# Argument validation: before any step runs, naming argument and value
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["batch_size", "max_batch_size", "steps"])
@pytest.mark.parametrize("value", [-3, 0, 2.5, True, "8"], ids=repr)
def test_bad_integer_arguments(inject_oom, name, value):
    inject_oom(None)
    with pytest.raises((ValueError, TypeError)) as excinfo:
        safe_predict(dense_model(), random_data(20), verbose=0, **{name: value})
    message = str(excinfo.value)
    assert name in message
    assert f"{name}={value!r}" in message
    assert inject_oom.calls == []


@pytest.mark.parametrize("value", [5, -1, "loud", 1.5], ids=repr)
def test_bad_verbose(inject_oom, value):
    inject_oom(None)
    with pytest.raises(ValueError) as excinfo:
        safe_predict(dense_model(), random_data(20), verbose=value)
    assert f"verbose={value!r}" in str(excinfo.value)
    assert inject_oom.calls == []


def test_numpy_integer_batch_size_is_accepted(inject_oom):
    model = dense_model()
    x = random_data(50)
    inject_oom(None)
    result = safe_predict(model, x, batch_size=np.int64(20), verbose=0)
    assert_same_result(result, reference(model, x))
    assert inject_oom.ok_rows() == [20, 20, 10]


@pytest.mark.parametrize(
    "out, expected_error, fragments",
    [
        (np.zeros((19, 3), "float32"), ValueError, ["20 rows", "(19, 3)"]),
        (np.zeros((20, 4), "float32"), ValueError, ["(20, 4)", "trailing shape"]),
        (np.zeros((20, 3), "float64"), ValueError, ["float64", "dtype"]),
        (np.zeros((20,), "float32"), ValueError, ["(20,)"]),
        ("out.npy", TypeError, ["str"]),
        (tf.zeros((20, 3)), TypeError, ["numpy array"]),
        ([np.zeros((20, 3), "float32"), np.zeros((20, 3), "float32")], ValueError,
         ["structure"]),
    ],
    ids=["rows", "trailing shape", "dtype", "rank", "str", "tensor", "structure"],
)
def test_bad_out(inject_oom, out, expected_error, fragments):
    inject_oom(None)
    with pytest.raises(expected_error) as excinfo:
        safe_predict(dense_model(), random_data(20), batch_size=8, verbose=0, out=out)
    message = str(excinfo.value)
    assert "out" in message
    for fragment in fragments:
        assert fragment in message
    assert inject_oom.calls == []


def test_read_only_out(inject_oom):
    out = np.zeros((20, 3), "float32")
    out.flags.writeable = False
    inject_oom(None)
    with pytest.raises(ValueError) as excinfo:
        safe_predict(dense_model(), random_data(20), verbose=0, out=out)
    assert "writeable" in str(excinfo.value)
    assert inject_oom.calls == []


@pytest.mark.parametrize(
    "model",
    [None, "my_model", lambda x: x, keras.layers.Dense(3)],
    ids=["None", "str", "function", "layer"],
)
def test_model_must_be_a_keras_model(inject_oom, model):
    inject_oom(None)
    with pytest.raises(TypeError) as excinfo:
        safe_predict(model, random_data(10), verbose=0)
    message = str(excinfo.value)
    assert "model must be a keras.Model" in message
    assert type(model).__name__ in message
    assert inject_oom.calls == []


@pytest.mark.parametrize("kind", ["dataset", "generator", "py_dataset"])
def test_batch_size_with_batched_input_is_ignored_as_keras_does(inject_oom, caplog, kind):
    # model.predict ignores batch_size for batched input; the drop-in too,
    # saying at INFO that it bounds nothing (issue 12, item 4).
    x = random_data(40)
    data = {
        "dataset": lambda: tf.data.Dataset.from_tensor_slices(x).batch(10),
        "generator": lambda: batches(x, [10, 30]),
        "py_dataset": lambda: Batches(x, batch_size=10),
    }
    model = dense_model()
    expected = model.predict(data[kind](), batch_size=16, verbose=0)
    inject_oom(None)
    with caplog.at_level(logging.INFO, logger="keras_memfit"):
        result = safe_predict(model, data[kind](), batch_size=16, verbose=0)
    np.testing.assert_allclose(result, expected, rtol=1e-5, atol=1e-6)
    assert inject_oom.ok_rows("predict") == ([10, 30] if kind == "generator" else [10] * 4)
    message = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.INFO)
    assert "batch_size=16 is ignored" in message and "max_batch_size" in message


def test_unsupported_input_type(inject_oom):
    inject_oom(None)
    with pytest.raises(TypeError) as excinfo:
        safe_predict(dense_model(), "not data", verbose=0)
    assert "str" in str(excinfo.value)
    assert inject_oom.calls == []


def test_inputs_with_different_lengths(inject_oom):
    model = two_input_model(as_dict=False)
    inject_oom(None)
    with pytest.raises(ValueError) as excinfo:
        safe_predict(model, [random_data(30, 4), random_data(29, 2)], verbose=0)
    assert "29" in str(excinfo.value) and "30" in str(excinfo.value)
    assert inject_oom.calls == []


# ---------------------------------------------------------------------------
# Errors that are not OOMs
# ---------------------------------------------------------------------------
class FailsAbove(keras.layers.Layer):
    """Raises ValueError (eagerly) for batches of more than `limit` rows."""

    raised = []

    def __init__(self, limit, **kwargs):
        super().__init__(**kwargs)
        self.limit = limit

    def call(self, x):
        rows = x.shape[0]
        if isinstance(rows, int) and rows > self.limit:  # None, or a JAX symbolic dimension
            err = ValueError(f"batch of {rows} rows is too large for this layer")
            FailsAbove.raised.append(err)
            raise err
        return x * 2.0


@torch_infers_shapes_by_calling
def test_non_oom_error_inside_the_model_propagates_unchanged():
    inputs = keras.Input((3,))
    model = keras.Model(inputs, FailsAbove(10)(inputs))
    model.run_eagerly = True
    x = random_data(40, 3)
    # What the model itself raises for this batch (Keras may annotate it).
    with pytest.raises(ValueError) as direct:
        model(x[:20])
    FailsAbove.raised.clear()
    with pytest.raises(Exception) as excinfo:
        safe_predict(model, x, batch_size=20, verbose=0)
    err = excinfo.value
    assert type(err) is ValueError
    assert not isinstance(err, OutOfMemoryError)
    assert "batch of 20 rows is too large for this layer" in str(err)
    assert str(err) == str(direct.value)
    assert len(FailsAbove.raised) == 1  # not retried


def test_non_oom_error_from_the_step_is_the_same_object(raising_step):
    original = runtime_error("Matrix size-incompatible")
    state = raising_step(original, above=0)
    with pytest.raises(type(original)) as excinfo:
        safe_predict(dense_model(), random_data(50), batch_size=25, verbose=0)
    assert excinfo.value is original
    assert excinfo.value.__cause__ is None
    assert state["calls"] == [25]  # not retried smaller


def test_non_oom_error_after_an_oom_propagates(inject_oom, monkeypatch):
    # An OOM first, then a non-OOM error on the retry: the latter propagates.
    model = dense_model()
    inject_oom(30)
    boom = ValueError("a real bug in the model")
    def to_numpy(value):
        raise boom

    monkeypatch.setattr(keras.ops, "convert_to_numpy", to_numpy)
    with pytest.raises(ValueError) as excinfo:
        safe_predict(model, random_data(50), batch_size=50, verbose=0)
    assert excinfo.value is boom
    assert inject_oom.ooms() == [50]


def test_keyboard_interrupt_propagates(raising_step):
    interrupt = KeyboardInterrupt()
    state = raising_step(interrupt, above=0)
    with pytest.raises(KeyboardInterrupt) as excinfo:
        safe_predict(dense_model(), random_data(50), batch_size=25, verbose=0)
    assert excinfo.value is interrupt
    assert state["calls"] == [25]


# ---------------------------------------------------------------------------
# A single sample that does not fit
# ---------------------------------------------------------------------------
def test_single_sample_failing_raises_out_of_memory_error(inject_oom):
    model = dense_model(name="too_big")
    inject_oom(0)
    with pytest.raises(OutOfMemoryError) as excinfo:
        safe_predict(model, random_data(64), batch_size=64, verbose=0)
    err = excinfo.value
    assert isinstance(err, oom_error_class())
    assert err.model_name == "too_big"
    assert err.phase == "predict"
    assert err.batch_shape == ((1, 4),)
    assert err.device == HOST_DEVICE
    assert isinstance(err.__cause__, oom_error_class())
    assert not isinstance(err.__cause__, OutOfMemoryError)
    assert "injected" in str(err.__cause__)
    assert inject_oom.ooms()[-1] == 1
    assert inject_oom.ok_rows() == []


def test_single_sample_failing_in_a_dataset(inject_oom):
    model = dense_model(name="too_big_ds")
    ds = tf.data.Dataset.from_tensor_slices(random_data(30)).batch(10)
    inject_oom(0)
    with pytest.raises(OutOfMemoryError) as excinfo:
        safe_predict(model, ds, verbose=0)
    assert excinfo.value.batch_shape == ((1, 4),)
