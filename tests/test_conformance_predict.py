"""Conformance: `safe_predict` against `model.predict` itself, for what Keras accepts.

For each class of issue 12 (input dtypes, sparse, ragged and optional
inputs, ragged outputs, `steps_per_execution` callbacks, positional
arguments): plain Keras and the drop-in on the same model and input, no
memory pressure, must return the same values (dtype, structure, ragged-ness)
and make the same callback calls in the same order; then the same with
`inject_oom` where batches can be split (the values stay Keras's).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_memfit import safe_predict
from support import (
    multi_step_execution,
    no_torch_sparse,
    KERAS_DROPIN_SINCE_3_13,
    Recorder,
    assert_same_result,
    keras_tensorflow_inputs,
    optional_input_model,
)

# On JAX, Keras's numpy iterator hands keras_memfit sparse batches densified,
# and a dense batch can be split: only on TensorFlow is a batch a SparseTensor.
SPARSE_BATCHES_ARE_TENSORFLOWS = pytest.mark.tensorflow(
    reason="sparse batches stay tf.SparseTensor (unsplittable) only on TensorFlow"
)



# ---------------------------------------------------------------------------
# Models and data
# ---------------------------------------------------------------------------
def _string_model():
    i = keras.Input((1,), dtype="string")
    return keras.Model(i, keras.layers.StringLookup(vocabulary=["a", "b"])(i))


def _strings(n=7):
    words = np.array([["a"], ["b"], ["c"]])[np.arange(n) % 3]
    return tf.constant(words)


def _ragged_input_model():
    i = keras.Input((None,), dtype="int32", ragged=True)
    # The mean over each row tells a ragged row from a zero-padded one.
    mean = keras.layers.Lambda(
        lambda r: tf.reduce_mean(tf.cast(r, "float32"), axis=1, keepdims=True)
    )(i)
    return keras.Model(i, mean)


def _ragged():
    return tf.ragged.constant([[1, 2], [3], [4, 5, 6], [7], [8, 9], [10, 11, 12, 13], [14]])


def _sparse_model():
    keras.utils.set_random_seed(5)
    i = keras.Input((3,), sparse=True)
    return keras.Model(i, keras.layers.Dense(2)(i))


def _sparse(n=7):
    return tf.sparse.from_dense(np.eye(3, dtype="float32")[np.arange(n) % 3] * 2.0)


class _Ranges(keras.layers.Layer):
    """Row i of the output is range(x[i, 0]): a ragged output."""

    def call(self, x):
        return tf.ragged.range(tf.cast(x[:, 0], tf.int64))

    def compute_output_spec(self, x):
        return keras.KerasTensor((x.shape[0], None), "int64", ragged=True)


def _ragged_output_model():
    i = keras.Input((1,))
    return keras.Model(i, _Ranges()(i))


def _counts(n=7):
    return (np.arange(n) % 4 + 1).astype("float32").reshape(n, 1)


def _dense_model():
    keras.utils.set_random_seed(2)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    return model


def _rows(n=28):
    return np.random.default_rng(0).normal(size=(n, 4)).astype("float32")


# ---------------------------------------------------------------------------
# Comparisons
# ---------------------------------------------------------------------------
def assert_same_output(got, want):
    """Same structure, dtypes and values; a RaggedTensor where Keras returns one."""
    if isinstance(want, tf.RaggedTensor):
        assert isinstance(got, tf.RaggedTensor), type(got)
        assert got.dtype == want.dtype
        assert got.to_list() == want.to_list()
    else:
        assert_same_result(got, want)


def _calls(recorder):
    return [(hook, batch) for hook, batch, _ in recorder.events]


def _batch_outputs(recorder):
    return [logs["outputs"] for hook, _, logs in recorder.events if hook == "predict_batch_end"]


def both(model, make_x, *args, **kwargs):
    """`model.predict` and `safe_predict` with the same arguments, each with a Recorder."""
    keras_rec, safe_rec = Recorder(), Recorder()
    kwargs.setdefault("verbose", 0)
    want = model.predict(make_x(), *args, callbacks=[keras_rec], **kwargs)
    got = safe_predict(model, make_x(), *args, callbacks=[safe_rec], **kwargs)
    return got, want, safe_rec, keras_rec


def assert_conforms(model, make_x, *args, **kwargs):
    got, want, safe_rec, keras_rec = both(model, make_x, *args, **kwargs)
    assert_same_output(got, want)
    assert _calls(safe_rec) == _calls(keras_rec)
    for mine, theirs in zip(_batch_outputs(safe_rec), _batch_outputs(keras_rec)):
        assert_same_output(mine, theirs)
    return got, want


# ---------------------------------------------------------------------------
# Input dtypes (item 1)
# ---------------------------------------------------------------------------
@KERAS_DROPIN_SINCE_3_13
@keras_tensorflow_inputs
def test_string_dataset_as_keras():
    def make():
        return tf.data.Dataset.from_tensor_slices(_strings()).batch(2)

    got, _ = assert_conforms(_string_model(), make)
    assert got.dtype == np.int64 and got.ravel().tolist() == [1, 2, 0, 1, 2, 0, 1]


@keras_tensorflow_inputs
def test_string_dataset_split_after_oom_as_keras(inject_oom):
    model = _string_model()
    want = model.predict(tf.data.Dataset.from_tensor_slices(_strings()).batch(4), verbose=0)
    inject_oom(2)
    got = safe_predict(model, tf.data.Dataset.from_tensor_slices(_strings()).batch(4), verbose=0)
    assert_same_output(got, want)
    assert inject_oom.ooms("predict") and max(inject_oom.ok_rows("predict")) <= 2


@KERAS_DROPIN_SINCE_3_13
@pytest.mark.parametrize(
    "dtype, make",
    [
        pytest.param("string", lambda: _strings(), marks=keras_tensorflow_inputs),
        ("bool", lambda: np.arange(14).reshape(7, 2) % 3 == 0),
        ("int64", lambda: np.arange(14, dtype="int64").reshape(7, 2)),
    ],
    ids=["string-tensor", "bool", "int64"],
)
def test_array_dtypes_as_keras(dtype, make):
    if dtype == "string":
        model = _string_model()
    else:
        i = keras.Input((2,), dtype=dtype)
        model = keras.Model(i, keras.layers.Lambda(lambda t: keras.ops.cast(t, "int64") * 3)(i))
    assert_conforms(model, make, 3)


# ---------------------------------------------------------------------------
# Ragged inputs
# ---------------------------------------------------------------------------
@KERAS_DROPIN_SINCE_3_13
@keras_tensorflow_inputs
def test_ragged_dataset_as_keras():
    assert_conforms(
        _ragged_input_model(), lambda: tf.data.Dataset.from_tensor_slices(_ragged()).batch(3)
    )


@KERAS_DROPIN_SINCE_3_13
@keras_tensorflow_inputs
def test_ragged_tensor_input_as_keras():
    assert_conforms(_ragged_input_model(), _ragged, 3)


@KERAS_DROPIN_SINCE_3_13
@keras_tensorflow_inputs
def test_ragged_input_split_after_oom_as_keras(inject_oom):
    model = _ragged_input_model()
    want = model.predict(_ragged(), batch_size=4, verbose=0)
    inject_oom(1)
    got = safe_predict(model, tf.data.Dataset.from_tensor_slices(_ragged()).batch(4), verbose=0)
    assert_same_output(got, want)
    assert set(inject_oom.ok_rows("predict")) == {1}


# ---------------------------------------------------------------------------
# Sparse inputs (item 3): Keras batches them, each batch runs whole
# ---------------------------------------------------------------------------
@no_torch_sparse
@KERAS_DROPIN_SINCE_3_13
def test_sparse_tensor_input_as_keras():
    assert_conforms(_sparse_model(), _sparse, 2)


@no_torch_sparse
@KERAS_DROPIN_SINCE_3_13
def test_sparse_dataset_as_keras():
    assert_conforms(
        _sparse_model(), lambda: tf.data.Dataset.from_tensor_slices(_sparse()).batch(3)
    )


@SPARSE_BATCHES_ARE_TENSORFLOWS
def test_sparse_input_that_runs_out_of_memory_says_it_cannot_be_split(inject_oom):
    inject_oom(1)
    with pytest.raises(TypeError) as excinfo:
        safe_predict(_sparse_model(), _sparse(), 4, verbose=0)
    message = str(excinfo.value)
    assert "SparseTensor" in message and "cannot split" in message
    assert "(4, 3)" in message and "batch_size" in message
    assert inject_oom.ooms("predict") == [4]


@no_torch_sparse
def test_scipy_sparse_input_as_keras():
    sparse = pytest.importorskip("scipy.sparse")
    dense = np.eye(3, dtype="float32")[np.arange(7) % 3]
    assert_conforms(_sparse_model(), lambda: sparse.csr_matrix(dense), 2)


# ---------------------------------------------------------------------------
# Optional inputs given as None (item 3)
# ---------------------------------------------------------------------------
def _with_none(n=7):
    return {"a": np.arange(2 * n, dtype="float32").reshape(n, 2), "o": None}


@KERAS_DROPIN_SINCE_3_13
def test_optional_none_input_as_keras():
    assert_conforms(optional_input_model(), _with_none, 3)


@KERAS_DROPIN_SINCE_3_13
def test_optional_none_input_from_a_generator_as_keras():
    def make():
        return (({"a": np.ones((3, 2), "float32") * k, "o": None},) for k in range(3))

    assert_conforms(optional_input_model(), make)


@KERAS_DROPIN_SINCE_3_13
def test_optional_none_input_split_after_oom_as_keras(inject_oom):
    model = optional_input_model()
    want = model.predict(_with_none(), batch_size=4, verbose=0)
    inject_oom(2)
    got = safe_predict(model, _with_none(), 4, verbose=0)
    assert_same_output(got, want)
    assert inject_oom.ooms("predict") == [4]


# ---------------------------------------------------------------------------
# Ragged outputs (item 3)
# ---------------------------------------------------------------------------
@KERAS_DROPIN_SINCE_3_13
@keras_tensorflow_inputs
def test_ragged_output_is_a_ragged_tensor_as_keras():
    got, _ = assert_conforms(_ragged_output_model(), _counts, 3)
    assert got.to_list()[:2] == [[0], [0, 1]]


@KERAS_DROPIN_SINCE_3_13
@keras_tensorflow_inputs
def test_ragged_output_in_one_batch_as_keras():
    assert_conforms(_ragged_output_model(), lambda: _counts(3), 8)


@KERAS_DROPIN_SINCE_3_13
@keras_tensorflow_inputs
def test_ragged_output_split_after_oom_as_keras(inject_oom):
    model = _ragged_output_model()
    want = model.predict(_counts(), batch_size=4, verbose=0)
    inject_oom(1)
    got = safe_predict(model, _counts(), 4, verbose=0)
    assert_same_output(got, want)
    assert set(inject_oom.ok_rows("predict")) == {1}


# ---------------------------------------------------------------------------
# steps_per_execution (item 3)
# ---------------------------------------------------------------------------
def _executing(model, per_execution=3):
    model.compile(loss="mse", steps_per_execution=per_execution)
    return model


@multi_step_execution
@KERAS_DROPIN_SINCE_3_13
def test_steps_per_execution_callbacks_as_keras():
    got, _ = assert_conforms(_executing(_dense_model()), _rows, 4)  # 7 batches
    keras_rec = Recorder()
    _executing(_dense_model()).predict(_rows(), 4, 0, callbacks=[keras_rec])
    assert [b for b, _ in keras_rec.of("predict_batch_begin")] == [0, 3, 6]


@multi_step_execution
@KERAS_DROPIN_SINCE_3_13
def test_steps_per_execution_with_a_dataset_as_keras():
    assert_conforms(
        _executing(_dense_model()),
        lambda: tf.data.Dataset.from_tensor_slices(_rows(26)).batch(4),
    )


@multi_step_execution
def test_steps_per_execution_after_an_oom_counts_pieces(inject_oom):
    # Documented: after an OOM each piece is a batch for the callbacks, and an
    # execution is steps_per_execution pieces; every row is in one batch_end.
    model = _executing(_dense_model())
    want = model.predict(_rows(), batch_size=4, verbose=0)
    inject_oom(2)
    recorder = Recorder()
    got = safe_predict(model, _rows(), 4, 0, callbacks=[recorder])
    assert_same_result(got, want)
    pieces = len(inject_oom.ok_rows("predict"))
    begins = [b for b, _ in recorder.of("predict_batch_begin")]
    ends = [b for b, _ in recorder.of("predict_batch_end")]
    assert begins == list(range(0, pieces, 3))
    assert ends == [b + 2 for b in begins]
    outputs = np.concatenate([logs["outputs"] for _, logs in recorder.of("predict_batch_end")])
    np.testing.assert_allclose(outputs, want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------
# Positional arguments (item 3) and batch_size with a dataset (item 4)
# ---------------------------------------------------------------------------
def test_positional_arguments_as_keras():
    model = _dense_model()
    keras_rec, safe_rec = Recorder(), Recorder()
    want = model.predict(_rows(), 4, 0, 5, [keras_rec])  # x, batch_size, verbose, steps, callbacks
    got = safe_predict(model, _rows(), 4, 0, 5, [safe_rec])
    assert_same_result(got, want)
    assert got.shape == (20, 3)
    assert _calls(safe_rec) == _calls(keras_rec)


def test_keras_memfit_arguments_are_keyword_only():
    with pytest.raises(TypeError):
        safe_predict(_dense_model(), _rows(), 4, 0, None, None, None)


def test_batch_size_with_a_dataset_is_ignored_as_keras():
    def make():
        return tf.data.Dataset.from_tensor_slices(_rows(10)).batch(3)

    got, want, safe_rec, keras_rec = both(_dense_model(), make, batch_size=8)
    assert_same_result(got, want)
    assert _calls(safe_rec) == _calls(keras_rec)
