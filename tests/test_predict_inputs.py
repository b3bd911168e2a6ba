"""`safe_predict` on every input kind, checked with fault injection against `model.predict`.

Arrays, tensors, lists and dicts of them, tf.data datasets, PyDatasets and
generators (with or without targets), integer and float64 inputs, jit: every
result equals the independent reference, `model.predict(x, batch_size=small,
verbose=0)` (`support.reference`): same structure, dtypes and row order,
values equal up to float rounding.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_memfit import safe_predict
from support import (
    Batches,
    assert_same_result,
    batches,
    dense_model,
    identity_model,
    multi_output_model,
    random_data,
    reference,
    rows_data,
    two_input_model,
)


# ---------------------------------------------------------------------------
# Input kinds
# ---------------------------------------------------------------------------
def test_numpy_input_without_oom(inject_oom):
    model = dense_model()
    x = random_data(200)
    inject_oom(None)
    result = safe_predict(model, x, batch_size=64, verbose=0)
    assert_same_result(result, reference(model, x))
    assert inject_oom.ooms() == []
    assert sum(inject_oom.ok_rows()) == 200


def test_numpy_input_under_oom(inject_oom):
    model = dense_model()
    x = random_data(500)
    inject_oom(40)
    result = safe_predict(model, x, batch_size=256, verbose=0)
    assert_same_result(result, reference(model, x))
    assert inject_oom.ooms(), "the injected OOM never triggered"
    assert all(rows <= 40 for rows in inject_oom.ok_rows())
    assert sum(inject_oom.ok_rows()) == 500


def test_default_batch_size_is_32(inject_oom):
    model = dense_model()
    x = random_data(100)
    inject_oom(None)
    result = safe_predict(model, x, verbose=0)
    assert_same_result(result, reference(model, x))
    assert inject_oom.ok_rows() == [32, 32, 32, 4]


def test_tf_tensor_input(inject_oom):
    model = dense_model()
    x = tf.constant(random_data(300))
    inject_oom(50)
    result = safe_predict(model, x, batch_size=200, verbose=0)
    assert_same_result(result, reference(model, x))
    assert inject_oom.ooms()
    assert sum(inject_oom.ok_rows()) == 300


@pytest.mark.parametrize("container", [list, tuple])
def test_list_input_of_multi_input_model(inject_oom, container):
    model = two_input_model(as_dict=False)
    x = container([random_data(300, 4, seed=1), random_data(300, 2, seed=2)])
    inject_oom(60)
    result = safe_predict(model, x, batch_size=300, verbose=0)
    assert_same_result(result, reference(model, x))
    assert inject_oom.ooms()
    assert sum(inject_oom.ok_rows()) == 300


def test_dict_input_of_multi_input_model(inject_oom):
    model = two_input_model(as_dict=True)
    x = {"a": random_data(300, 4, seed=1), "b": random_data(300, 2, seed=2)}
    inject_oom(60)
    result = safe_predict(model, x, batch_size=300, verbose=0)
    assert_same_result(result, reference(model, x))
    assert inject_oom.ooms()


def test_dict_dataset_of_multi_input_model(inject_oom):
    model = two_input_model(as_dict=True)
    x = {"a": random_data(150, 4, seed=1), "b": random_data(150, 2, seed=2)}
    ds = tf.data.Dataset.from_tensor_slices(x).batch(70)
    inject_oom(20)
    result = safe_predict(model, ds, verbose=0)
    assert_same_result(result, reference(model, ds))
    assert inject_oom.ooms()


@pytest.mark.parametrize("as_dict", [False, True], ids=["list", "dict"])
def test_multi_output(inject_oom, as_dict):
    model = multi_output_model(as_dict)
    x = random_data(400)
    inject_oom(70)
    result = safe_predict(model, x, batch_size=300, verbose=0)
    expected = reference(model, x)
    assert isinstance(expected, dict if as_dict else list)
    assert_same_result(result, expected)
    assert inject_oom.ooms()


def test_multi_output_with_mixed_dtypes(inject_oom):
    inputs = keras.Input((4,))
    h = keras.layers.Dense(5)(inputs)
    labels = keras.layers.Lambda(lambda t: keras.ops.argmax(t, axis=-1))(h)
    model = keras.Model(inputs, [h, labels])
    x = random_data(150)
    inject_oom(30)
    result = safe_predict(model, x, batch_size=100, verbose=0)
    expected = reference(model, x)
    assert_same_result(result, expected)
    assert result[1].dtype != result[0].dtype  # the int output stayed int


def test_batched_dataset(inject_oom):
    model = dense_model()
    x = random_data(250)
    ds = tf.data.Dataset.from_tensor_slices(x).batch(100)
    inject_oom(None)
    result = safe_predict(model, ds, verbose=0)
    assert_same_result(result, reference(model, ds))
    # Without OOM the dataset's own batches are run as they come (no probing
    # split would change results, but every sample is seen once).
    assert sum(inject_oom.ok_rows()) == 250


@pytest.mark.parametrize("element", ["x_y", "x_y_weight"])
def test_batched_dataset_of_x_y_pairs_is_split_under_oom(inject_oom, element):
    model = dense_model()
    x = random_data(250)
    y = np.zeros((250, 3), "float32")
    parts = (x, y) if element == "x_y" else (x, y, np.ones((250,), "float32"))
    ds = tf.data.Dataset.from_tensor_slices(parts).batch(100)
    inject_oom(30)
    result = safe_predict(model, ds, verbose=0)
    assert_same_result(result, reference(model, ds))
    assert inject_oom.ooms(), "the dataset's batches were never too large"
    assert all(rows <= 30 for rows in inject_oom.ok_rows())
    assert sum(inject_oom.ok_rows()) == 250


def test_dataset_row_order_survives_splitting(inject_oom):
    model = identity_model()
    x = rows_data(250)
    ds = tf.data.Dataset.from_tensor_slices(x).batch(100)
    inject_oom(30)
    result = safe_predict(model, ds, verbose=0)
    np.testing.assert_array_equal(result, x)
    assert_same_result(result, reference(model, ds))


@pytest.mark.parametrize("with_y", [False, True], ids=["x", "x_y"])
def test_py_dataset(inject_oom, with_y):
    model = dense_model()
    x = random_data(230)
    y = np.zeros((len(x), 1), "float32") if with_y else None
    data = Batches(x, y, batch_size=90)
    inject_oom(25)
    result = safe_predict(model, data, verbose=0)
    assert_same_result(result, reference(model, data))
    assert inject_oom.ooms()
    assert sum(inject_oom.ok_rows()) == 230


def test_generator(inject_oom):
    model = dense_model()
    x = random_data(230)
    sizes = [100, 100, 30]
    inject_oom(40)
    result = safe_predict(model, batches(x, sizes), verbose=0)
    assert_same_result(result, reference(model, batches(x, sizes)))
    assert inject_oom.ooms()
    assert sum(inject_oom.ok_rows()) == 230


def test_generator_of_x_y_pairs_keeps_row_order(inject_oom):
    model = identity_model()
    x = rows_data(230)

    def gen():
        for (batch,) in batches(x, [50, 120, 60]):
            yield batch, np.ones((len(batch), 1))

    inject_oom(33)
    result = safe_predict(model, gen(), verbose=0)
    np.testing.assert_array_equal(result, x)
    assert_same_result(result, reference(model, gen()))


def test_generator_of_bare_arrays_error_gives_the_reason(inject_oom):
    # Keras requires generators to yield tuples; model.predict says so. The
    # error must say so too, rather than claim that generators are unsupported.
    model = dense_model()

    def gen():
        yield random_data(10)

    with pytest.raises(ValueError) as expected:
        model.predict(gen(), verbose=0)
    assert "tuple" in str(expected.value)
    inject_oom(None)
    with pytest.raises((ValueError, TypeError)) as excinfo:
        safe_predict(model, gen(), verbose=0)
    assert "tuple" in str(excinfo.value)
    assert inject_oom.calls == []


def test_error_in_user_generator_propagates(inject_oom):
    model = dense_model()
    boom = RuntimeError("the generator broke")

    def gen():
        yield (random_data(10),)
        raise boom

    inject_oom(None)
    with pytest.raises(RuntimeError) as excinfo:
        safe_predict(model, gen(), verbose=0)
    assert excinfo.value is boom


def test_integer_token_input(inject_oom):
    keras.utils.set_random_seed(5)
    model = keras.Sequential([
        keras.Input((7,), dtype="int32"),
        keras.layers.Embedding(100, 4),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(2),
    ])
    x = np.random.default_rng(0).integers(0, 100, (180, 7)).astype("int32")
    inject_oom(40)
    result = safe_predict(model, x, batch_size=150, verbose=0)
    assert_same_result(result, reference(model, x))
    assert inject_oom.ooms()


def test_float64_input_and_float16_output(inject_oom):
    keras.utils.set_random_seed(6)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, dtype="float16")])
    x = random_data(90).astype("float64")
    inject_oom(25)
    result = safe_predict(model, x, batch_size=64, verbose=0)
    expected = reference(model, x)
    assert expected.dtype == np.float16
    assert_same_result(result, expected)


def test_jit_compiled_model(inject_oom):
    model = dense_model()
    model.compile(jit_compile=True)
    x = random_data(150)
    inject_oom(40)
    result = safe_predict(model, x, batch_size=100, verbose=0)
    assert_same_result(result, reference(model, x))
    assert inject_oom.ooms()


def test_fewer_samples_than_the_batch(inject_oom):
    model = identity_model()
    x = rows_data(10)
    inject_oom(3)
    result = safe_predict(model, x, batch_size=1000, verbose=0)
    np.testing.assert_array_equal(result, x)
    assert sum(inject_oom.ok_rows()) == 10
