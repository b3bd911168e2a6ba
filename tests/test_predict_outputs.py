"""What `safe_predict` returns: in `out=` arrays and memmaps, via `postprocess`, for no input."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_memfit import safe_predict
from support import (
    ATOL,
    RTOL,
    assert_same_result,
    dense_model,
    multi_output_model,
    random_data,
    reference,
)


# ---------------------------------------------------------------------------
# out=
# ---------------------------------------------------------------------------
def test_out_preallocated_array(inject_oom):
    model = dense_model()
    x = random_data(300)
    out = np.full((300, 3), np.nan, "float32")
    inject_oom(50)
    result = safe_predict(model, x, batch_size=200, out=out, verbose=0)
    assert result is out
    assert_same_result(out, reference(model, x))
    assert inject_oom.ooms()


def test_out_memmap(inject_oom, tmp_path):
    model = dense_model()
    x = random_data(300)
    path = tmp_path / "predictions.dat"
    out = np.memmap(path, dtype="float32", mode="w+", shape=(300, 3))
    inject_oom(50)
    result = safe_predict(model, x, batch_size=200, out=out, verbose=0)
    assert result is out
    out.flush()
    on_disk = np.array(np.memmap(path, dtype="float32", mode="r", shape=(300, 3)))
    assert_same_result(on_disk, reference(model, x))
    assert inject_oom.ooms()


def test_out_for_multi_output_model(inject_oom):
    model = multi_output_model(as_dict=True)
    x = random_data(120)
    out = {"probs": np.zeros((120, 5), "float32"), "value": np.zeros((120, 1), "float32")}
    inject_oom(30)
    result = safe_predict(model, x, batch_size=100, out=out, verbose=0)
    assert result is out
    assert_same_result({k: out[k] for k in out}, reference(model, x))


def test_out_with_dataset_input(inject_oom):
    model = dense_model()
    x = random_data(250)
    ds = tf.data.Dataset.from_tensor_slices(x).batch(100)
    out = np.zeros((250, 3), "float32")
    inject_oom(30)
    result = safe_predict(model, ds, out=out, verbose=0)
    assert result is out
    assert_same_result(out, reference(model, ds))


# ---------------------------------------------------------------------------
# postprocess
# ---------------------------------------------------------------------------
def test_postprocess_argmax(inject_oom):
    model = dense_model(out_dim=10)
    x = random_data(400)
    inject_oom(70)
    result = safe_predict(
        model, x, batch_size=300, verbose=0,
        postprocess=lambda y: keras.ops.argmax(y, -1),
    )
    expected = reference(model, x).argmax(-1)
    assert isinstance(result, np.ndarray)
    assert result.shape == (400,)
    assert np.issubdtype(result.dtype, np.integer)
    np.testing.assert_array_equal(result, expected)
    assert inject_oom.ooms()


def test_postprocess_receives_structured_outputs(inject_oom):
    model = multi_output_model(as_dict=True)
    x = random_data(100)
    inject_oom(30)
    result = safe_predict(
        model, x, batch_size=64, verbose=0,
        postprocess=lambda y: y["value"] * 2.0,
    )
    np.testing.assert_allclose(result, reference(model, x)["value"] * 2.0, rtol=RTOL,
                               atol=ATOL)


class NotATensor:
    pass


@pytest.mark.parametrize("eager", [False, True], ids=["compiled", "eager"])
@pytest.mark.parametrize(
    "postprocess",
    [lambda y: None, lambda y: NotATensor(), lambda y: [y, None]],
    ids=["None", "object", "list with None"],
)
def test_postprocess_returning_a_non_tensor_is_a_type_error(inject_oom, postprocess, eager):
    # E.g. a postprocess that forgot its `return`. The docstring promises a
    # TypeError; a ValueError about "one row per sample" would mislead.
    model = dense_model()
    model.run_eagerly = eager
    inject_oom(None)
    with pytest.raises(TypeError) as excinfo:
        safe_predict(model, random_data(50), batch_size=10, verbose=0,
                     postprocess=postprocess)
    assert excinfo.value is not None


def test_postprocess_returning_none_fails_before_any_step(inject_oom):
    model = dense_model()
    inject_oom(None)
    with pytest.raises(TypeError) as excinfo:
        safe_predict(model, random_data(50), batch_size=10, verbose=0,
                     postprocess=lambda y: None)
    assert "postprocess" in str(excinfo.value)
    assert "NoneType" in str(excinfo.value)
    assert inject_oom.calls == []


def test_postprocess_returning_a_python_scalar_is_rejected(inject_oom):
    # tf.function turns `3` into a scalar tensor, so a ValueError about the
    # batch dimension is acceptable here; it must name postprocess.
    model = dense_model()
    inject_oom(None)
    with pytest.raises((TypeError, ValueError)) as excinfo:
        safe_predict(model, random_data(50), batch_size=10, verbose=0,
                     postprocess=lambda y: 3)
    assert "postprocess" in str(excinfo.value)
    assert inject_oom.calls == []


def test_postprocess_dropping_the_batch_dim_is_a_value_error(inject_oom):
    model = dense_model()
    inject_oom(None)
    with pytest.raises(ValueError) as excinfo:
        safe_predict(model, random_data(50), batch_size=10, verbose=0,
                     postprocess=lambda y: keras.ops.sum(y))
    assert "postprocess" in str(excinfo.value)
    assert "batch dimension" in str(excinfo.value)
    assert inject_oom.calls == []


def test_postprocess_dropping_the_batch_dim_when_eager_is_a_value_error(inject_oom):
    model = dense_model()
    model.run_eagerly = True
    inject_oom(None)
    with pytest.raises(ValueError) as excinfo:
        safe_predict(model, random_data(50), batch_size=10, verbose=0,
                     postprocess=lambda y: keras.ops.sum(y, axis=0))
    assert "postprocess" in str(excinfo.value)


def test_postprocess_not_callable(inject_oom):
    inject_oom(None)
    with pytest.raises(TypeError) as excinfo:
        safe_predict(dense_model(), random_data(10), verbose=0, postprocess="argmax")
    assert "postprocess" in str(excinfo.value) and "'argmax'" in str(excinfo.value)
    assert inject_oom.calls == []


# ---------------------------------------------------------------------------
# Empty input
# ---------------------------------------------------------------------------
def test_empty_input(inject_oom):
    model = dense_model()
    inject_oom(None)
    result = safe_predict(model, np.zeros((0, 4), "float32"), verbose=0)
    assert isinstance(result, np.ndarray)
    assert result.shape == (0, 3)
    assert result.dtype == np.float32
    assert inject_oom.calls == []


def test_empty_input_multi_output_with_postprocess(inject_oom):
    model = multi_output_model(as_dict=True)
    inject_oom(None)
    result = safe_predict(model, np.zeros((0, 4), "float32"), verbose=0)
    assert isinstance(result, dict)
    assert result["probs"].shape == (0, 5) and result["probs"].dtype == np.float32
    assert result["value"].shape == (0, 1)
    labels = safe_predict(model, np.zeros((0, 4), "float32"), verbose=0,
                          postprocess=lambda y: keras.ops.argmax(y["probs"], -1))
    assert labels.shape == (0,)
    assert np.issubdtype(labels.dtype, np.integer)


def test_empty_input_with_out(inject_oom):
    model = dense_model()
    out = np.zeros((0, 3), "float32")
    inject_oom(None)
    result = safe_predict(model, np.zeros((0, 4), "float32"), verbose=0, out=out)
    assert result.shape == (0, 3) and result.dtype == np.float32


def test_dataset_with_no_batches(inject_oom):
    model = dense_model()
    ds = tf.data.Dataset.from_tensor_slices(np.zeros((0, 4), "float32")).batch(8)
    inject_oom(None)
    with pytest.raises(ValueError) as excinfo:
        safe_predict(model, ds, verbose=0)
    assert "no batches" in str(excinfo.value)
