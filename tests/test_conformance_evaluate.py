"""Conformance: `safe_evaluate` against `model.evaluate` itself, for what Keras accepts.

Plain Keras and the drop-in on the same compiled model and input, no memory
pressure: the same values (per-output losses of a multi-output model
included: Keras's mean of batch means), the same `return_dict` keys in the
same order, the same callback calls in the same order, the same errors; then
with `inject_oom` splitting batches, where the values must stay Keras's (a
split batch counts as the one batch it is).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_memfit import backend, safe_evaluate
from support import (
    multi_step_execution,
    no_torch_sparse,
    KERAS_DROPIN_SINCE_3_13,
    Batches,
    Recorder,
    keras_tensorflow_inputs,
    optional_input_model,
)


RTOL = 1e-5


# ---------------------------------------------------------------------------
# Models and data
# ---------------------------------------------------------------------------
pytestmark = pytest.mark.usefixtures("probing_planner")


def _two_outputs(per_execution=1):
    keras.utils.set_random_seed(7)
    inputs = keras.Input((4,))
    h = keras.layers.Dense(6, activation="tanh")(inputs)
    outputs = {
        "value": keras.layers.Dense(1, name="value")(h),
        "probs": keras.layers.Dense(3, activation="softmax", name="probs")(h),
    }
    model = keras.Model(inputs, outputs)
    model.compile(
        optimizer="sgd",
        loss={"value": "mse", "probs": "sparse_categorical_crossentropy"},
        metrics={"probs": ["accuracy"], "value": ["mae"]},
        steps_per_execution=per_execution,
    )
    return model


def _data(n=40):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(n, 4)).astype("float32")
    # Later rows have larger targets, so a short last batch weighs differently.
    y = {
        "value": (np.arange(n, dtype="float32") / 4).reshape(n, 1),
        "probs": rng.integers(0, 3, size=(n, 1)),
    }
    return x, y


def _slice(structure, start, stop):
    return keras.tree.map_structure(lambda a: a[start:stop], structure)


def _generator(x, y, batch):
    for start in range(0, len(x), batch):
        yield x[start:start + batch], _slice(y, start, start + batch)


def _inputs(kind, batch=16):
    """(args for evaluate, kwargs) for one input kind, freshly made."""
    x, y = _data()
    if kind == "arrays":
        return (x, y), {"batch_size": batch}
    if kind == "dataset":
        return (tf.data.Dataset.from_tensor_slices((x, y)).batch(batch),), {}
    if kind == "generator":
        return (_generator(x, y, batch),), {}
    return (_DictBatches(x, y, batch),), {}


class _DictBatches(Batches):
    def __getitem__(self, index):
        rows = slice(index * self.batch_size, (index + 1) * self.batch_size)
        return self.x[rows], _slice(self.y, rows.start, rows.stop)


def _calls(recorder):
    return [(hook, batch) for hook, batch, _ in recorder.events]


def assert_same_logs(got, want):
    assert list(got) == list(want)  # same keys, same order
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=RTOL, err_msg=key)


def both(model, make, **kwargs):
    """`model.evaluate` and `safe_evaluate` on freshly made input, each with a Recorder."""
    keras_rec, safe_rec = Recorder(), Recorder()
    kwargs.setdefault("verbose", 0)
    args, extra = make()
    want = model.evaluate(*args, callbacks=[keras_rec], **extra, **kwargs)
    args, extra = make()
    got = safe_evaluate(model, *args, callbacks=[safe_rec], **extra, **kwargs)
    return got, want, safe_rec, keras_rec


# ---------------------------------------------------------------------------
# Multi-output losses and return_dict (item 2)
# ---------------------------------------------------------------------------
KINDS = ["arrays", "dataset", "generator", "py_dataset"]


@pytest.mark.parametrize("kind", KINDS)
def test_multi_output_return_dict_as_keras(kind):
    got, want, safe_rec, keras_rec = both(
        _two_outputs(), lambda: _inputs(kind), return_dict=True
    )
    assert _calls(safe_rec) == _calls(keras_rec)
    if kind == "generator":
        # Keras on TensorFlow runs one more, empty, step at the end of an input
        # of unknown length, which counts as a batch of loss 0 in the
        # per-output losses (theirs are k/(k+1) of the mean of batch means).
        # safe_evaluate does not copy that: its values are Keras's for the
        # same batches from an input of known length.
        want = _two_outputs().evaluate(*_inputs("dataset")[0], verbose=0, return_dict=True)
        assert_same_logs(got, want)
        return
    assert_same_logs(got, want)
    for (_, mine), (_, theirs) in zip(safe_rec.of("test_batch_end"), keras_rec.of("test_batch_end")):
        assert_same_logs(mine, theirs)


def test_multi_output_list_as_keras():
    got, want, _, _ = both(_two_outputs(), lambda: _inputs("arrays"))
    np.testing.assert_allclose(got, want, rtol=RTOL)


@pytest.mark.parametrize("kind", ["arrays", "dataset"])
def test_multi_output_split_after_oom_counts_each_batch_once_as_keras(inject_oom, kind):
    model = _two_outputs()
    args, extra = _inputs(kind)
    want = model.evaluate(*args, verbose=0, return_dict=True, **extra)
    inject_oom(5)
    args, extra = _inputs(kind)
    got = safe_evaluate(model, *args, verbose=0, return_dict=True, **extra)
    assert_same_logs(got, want)
    assert inject_oom.ooms("evaluate") and max(inject_oom.ok_rows("evaluate")) <= 5


def test_multi_output_with_sample_weights_split_after_oom_as_keras(inject_oom):
    x, y = _data()
    weights = np.linspace(0.1, 2.0, 40).astype("float32")
    model = _two_outputs()
    want = model.evaluate(x, y, 16, 0, weights, return_dict=True)
    inject_oom(6)
    got = safe_evaluate(model, x, y, 16, 0, weights, return_dict=True)
    assert_same_logs(got, want)
    assert inject_oom.ooms("evaluate")


def test_multi_output_run_eagerly_as_keras(inject_oom):
    # Run eagerly, Keras weights each batch by its rows: the exact mean.
    model = _two_outputs()
    model.run_eagerly = True
    x, y = _data()
    want = model.evaluate(x, y, 16, 0, return_dict=True)
    assert_same_logs(safe_evaluate(model, x, y, 16, 0, return_dict=True), want)
    inject_oom(5)
    assert_same_logs(safe_evaluate(model, x, y, 16, 0, return_dict=True), want)


def _exact_losses(model):
    x, y = _data()
    predicted = model.predict(x, batch_size=40, verbose=0)
    value = float(np.mean((predicted["value"] - y["value"]) ** 2))
    probs = np.take_along_axis(predicted["probs"], y["probs"], axis=1)
    return {"probs_loss": float(np.mean(-np.log(probs))), "value_loss": value}


def test_exact_output_losses_are_means_over_samples(inject_oom):
    model = _two_outputs()
    expected = _exact_losses(model)
    x, y = _data()
    got = safe_evaluate(model, x, y, 16, 0, return_dict=True, exact_output_losses=True)
    keras_logs = model.evaluate(x, y, 16, 0, return_dict=True)
    for key, value in expected.items():
        np.testing.assert_allclose(got[key], value, rtol=RTOL)
        if backend.get().KERAS_COUNTS_EACH_BATCH_ONCE:
            assert abs(keras_logs[key] - value) > 1e-3  # the difference is real here
        else:  # Keras on JAX already weights each batch by its rows
            np.testing.assert_allclose(keras_logs[key], value, rtol=RTOL)
    np.testing.assert_allclose(got["loss"], keras_logs["loss"], rtol=RTOL)
    inject_oom(5)
    split = safe_evaluate(model, x, y, 16, 0, return_dict=True, exact_output_losses=True)
    assert_same_logs(split, got)


# ---------------------------------------------------------------------------
# Input dtypes (item 1), sparse and optional inputs (item 3)
# ---------------------------------------------------------------------------
def _string_regressor():
    keras.utils.set_random_seed(1)
    i = keras.Input((1,), dtype="string")
    ids = keras.layers.StringLookup(vocabulary=["a", "b"])(i)
    h = keras.layers.Flatten()(keras.layers.Embedding(3, 2)(ids))
    model = keras.Model(i, keras.layers.Dense(1)(h))
    model.compile(loss="mse", metrics=["mae"])
    return model


def _string_dataset(batch=3):
    words = tf.constant(np.array([["a"], ["b"], ["c"]])[np.arange(8) % 3])
    return tf.data.Dataset.from_tensor_slices((words, np.arange(8, dtype="float32"))).batch(batch)


@keras_tensorflow_inputs
def test_string_dataset_as_keras():
    def make():
        return (_string_dataset(),), {}

    got, want, safe_rec, keras_rec = both(_string_regressor(), make, return_dict=True)
    assert_same_logs(got, want)
    assert _calls(safe_rec) == _calls(keras_rec)


@keras_tensorflow_inputs
def test_string_dataset_split_after_oom_as_keras(inject_oom):
    model = _string_regressor()
    want = model.evaluate(_string_dataset(4), verbose=0, return_dict=True)
    inject_oom(1)
    got = safe_evaluate(model, _string_dataset(4), verbose=0, return_dict=True)
    assert_same_logs(got, want)
    assert set(inject_oom.ok_rows("evaluate")) == {1}


def _sparse_regressor():
    keras.utils.set_random_seed(5)
    i = keras.Input((3,), sparse=True)
    model = keras.Model(i, keras.layers.Dense(1)(i))
    model.compile(loss="mse")
    return model


def _sparse_xy(n=7):
    x = tf.sparse.from_dense(np.eye(3, dtype="float32")[np.arange(n) % 3])
    return x, np.arange(n, dtype="float32").reshape(n, 1)


@no_torch_sparse
def test_sparse_input_as_keras():
    got, want, safe_rec, keras_rec = both(
        _sparse_regressor(), lambda: (_sparse_xy(), {"batch_size": 2}), return_dict=True
    )
    assert_same_logs(got, want)
    assert _calls(safe_rec) == _calls(keras_rec)


@no_torch_sparse
def test_scipy_sparse_input_as_keras():
    sparse = pytest.importorskip("scipy.sparse")
    x, y = _sparse_xy()
    matrix = sparse.csr_matrix(tf.sparse.to_dense(x).numpy())
    got, want, safe_rec, keras_rec = both(
        _sparse_regressor(), lambda: ((matrix, y), {"batch_size": 3}), return_dict=True
    )
    assert_same_logs(got, want)
    assert _calls(safe_rec) == _calls(keras_rec)


@pytest.mark.tensorflow(
    reason="sparse batches stay tf.SparseTensor (unsplittable) only on TensorFlow"
)
def test_sparse_input_that_runs_out_of_memory_says_it_cannot_be_split(inject_oom):
    inject_oom(1)
    x, y = _sparse_xy()
    with pytest.raises(TypeError, match=r"cannot split sparse input; received a SparseTensor"):
        safe_evaluate(_sparse_regressor(), x, y, 4, 0)


@KERAS_DROPIN_SINCE_3_13
def test_optional_none_input_as_keras(inject_oom):
    x = {"a": np.arange(14, dtype="float32").reshape(7, 2), "o": None}
    y = np.ones((7, 2), "float32")
    got, want, safe_rec, keras_rec = both(
        optional_input_model(loss="mse"), lambda: ((x, y), {"batch_size": 3}), return_dict=True
    )
    assert_same_logs(got, want)
    assert _calls(safe_rec) == _calls(keras_rec)
    inject_oom(1)
    got = safe_evaluate(optional_input_model(loss="mse"), x, y, 3, 0, return_dict=True)
    assert_same_logs(got, want)


# ---------------------------------------------------------------------------
# steps_per_execution, positional arguments, unknown keywords (item 3)
# ---------------------------------------------------------------------------
@multi_step_execution
@KERAS_DROPIN_SINCE_3_13
def test_steps_per_execution_callbacks_as_keras():
    x, y = _data(28)
    got, want, safe_rec, keras_rec = both(
        _two_outputs(per_execution=3), lambda: ((x, y), {"batch_size": 4}), return_dict=True
    )
    assert [b for b, _ in keras_rec.of("test_batch_begin")] == [0, 3, 6]
    assert _calls(safe_rec) == _calls(keras_rec)
    assert_same_logs(got, want)
    for (_, mine), (_, theirs) in zip(safe_rec.of("test_batch_end"), keras_rec.of("test_batch_end")):
        assert_same_logs(mine, theirs)


def test_positional_arguments_as_keras():
    x, y = _data()
    weights = np.linspace(0.5, 1.5, 40).astype("float32")
    model = _two_outputs()
    keras_rec, safe_rec = Recorder(), Recorder()
    # x, y, batch_size, verbose, sample_weight, steps, callbacks, return_dict
    want = model.evaluate(x, y, 8, 0, weights, 3, [keras_rec], True)
    got = safe_evaluate(model, x, y, 8, 0, weights, 3, [safe_rec], True)
    assert_same_logs(got, want)
    assert _calls(safe_rec) == _calls(keras_rec)


def test_unknown_keyword_raises_value_error_as_keras():
    x, y = _data()
    model = _two_outputs()
    with pytest.raises(ValueError, match="Arguments not recognized") as keras_error:
        model.evaluate(x, y, verbose=0, nope=1)
    with pytest.raises(ValueError, match="Arguments not recognized") as safe_error:
        safe_evaluate(model, x, y, verbose=0, nope=1)
    assert "'nope': 1" in str(safe_error.value) and "'nope': 1" in str(keras_error.value)


def test_batch_size_with_a_dataset_is_ignored_as_keras():
    got, want, safe_rec, keras_rec = both(
        _two_outputs(), lambda: _inputs("dataset"), batch_size=5, return_dict=True
    )
    assert_same_logs(got, want)
    assert _calls(safe_rec) == _calls(keras_rec)
