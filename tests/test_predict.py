"""`safe_predict` behaviour, checked with fault injection against `model.predict`.

Every result is compared with an independent reference, `model.predict(x,
batch_size=small, verbose=0)`: same structure, same dtypes, same row order,
values equal up to float rounding.
"""

from __future__ import annotations

import logging
import re
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_memfit import _cache
from keras_memfit import OutOfMemoryError, safe_predict
from keras_memfit.backend import tensorflow as tf_backend

RTOL, ATOL = 1e-5, 1e-6
REF_BATCH = 16


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------
def dense_model(in_dim=4, out_dim=3, seed=0, name=None):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((in_dim,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    outputs = keras.layers.Dense(out_dim)(hidden)
    return keras.Model(inputs, outputs, name=name)


def identity_model(dim=2):
    """Outputs its input exactly: row i of the output is row i of the input."""
    inputs = keras.Input((dim,))
    outputs = keras.layers.Dense(
        dim, kernel_initializer="identity", bias_initializer="zeros"
    )(inputs)
    return keras.Model(inputs, outputs)


def rows_data(n, dim=2):
    """Row i is (i, -i, ...): every row is recognisable by its first column."""
    x = np.zeros((n, dim), "float32")
    x[:, 0] = np.arange(n)
    if dim > 1:
        x[:, 1] = -np.arange(n)
    return x


def random_data(n, dim=4, seed=1):
    return np.random.default_rng(seed).normal(size=(n, dim)).astype("float32")


def reference(model, x, **kwargs):
    """`model.predict` itself, in small batches: the independent reference."""
    if _is_arrays(x):
        kwargs.setdefault("batch_size", REF_BATCH)
    return model.predict(x, verbose=0, **kwargs)


def _is_arrays(x):
    leaves = keras.tree.flatten(x)
    return all(isinstance(a, np.ndarray) or tf.is_tensor(a) for a in leaves)


def assert_same_result(result, expected):
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


def ok_rows(injector):
    """Row counts of the pieces that succeeded, in order."""
    return [rows for phase, rows, raised in injector.calls if not raised]


@pytest.fixture
def fault_at(monkeypatch):
    """Fault injection by content: OOM when a piece holds a poisoned row.

    `fault_at(poison, max_rows)` makes keras_memfit's predict steps raise a
    real `ResourceExhaustedError` when the piece contains a row whose first
    column equals `poison` and the piece has more than `max_rows` rows (as if
    that sample were much larger than the others). `.pieces` records the
    first-column values of every piece that ran successfully.
    """

    class Fault:
        poison = None
        max_rows = None
        pieces = []
        failed = []

        def __call__(self, poison, max_rows):
            self.poison, self.max_rows = poison, max_rows
            return self

    fault = Fault()
    fault.pieces, fault.failed = [], []
    make_predict = tf_backend.make_predict_step

    def make_predict_step(model, postprocess=None):
        real = make_predict(model, postprocess)

        def step(x):
            ids = np.asarray(x)[:, 0].astype(int).tolist()
            if fault.poison in ids and len(ids) > fault.max_rows:
                fault.failed.append(ids)
                raise tf.errors.ResourceExhaustedError(
                    None, None, f"OOM when allocating tensor with shape[{len(ids)},2]"
                )
            fault.pieces.append(ids)
            return real(x)

        step.__wrapped__ = real
        return step

    monkeypatch.setattr(tf_backend, "make_predict_step", make_predict_step)
    _cache.clear()  # steps compiled before the patch would bypass it
    return fault


@pytest.fixture
def raising_step(monkeypatch):
    """`raising_step(exc, above)`: predict steps raise `exc` itself above `above` rows."""
    state = {"exc": None, "above": 0, "calls": []}
    make_predict = tf_backend.make_predict_step

    def make_predict_step(model, postprocess=None):
        real = make_predict(model, postprocess)

        def step(x):
            rows = int(keras.tree.flatten(x)[0].shape[0])
            state["calls"].append(rows)
            if rows > state["above"]:
                raise state["exc"]
            return real(x)

        step.__wrapped__ = real
        return step

    monkeypatch.setattr(tf_backend, "make_predict_step", make_predict_step)
    _cache.clear()  # steps compiled before the patch would bypass it

    def configure(exc, above=0):
        state["exc"], state["above"] = exc, above
        return state

    return configure


# ---------------------------------------------------------------------------
# Input kinds
# ---------------------------------------------------------------------------
def test_numpy_input_without_oom(inject_oom):
    model = dense_model()
    x = random_data(200)
    inject_oom(None)
    result = safe_predict(model, x, batch_size=64, verbose=0)
    assert_same_result(result, reference(model, x))
    assert inject_oom.ooms == []
    assert sum(ok_rows(inject_oom)) == 200


def test_numpy_input_under_oom(inject_oom):
    model = dense_model()
    x = random_data(500)
    inject_oom(40)
    result = safe_predict(model, x, batch_size=256, verbose=0)
    assert_same_result(result, reference(model, x))
    assert inject_oom.ooms, "the injected OOM never triggered"
    assert all(rows <= 40 for rows in ok_rows(inject_oom))
    assert sum(ok_rows(inject_oom)) == 500


def test_default_batch_size_is_32(inject_oom):
    model = dense_model()
    x = random_data(100)
    inject_oom(None)
    result = safe_predict(model, x, verbose=0)
    assert_same_result(result, reference(model, x))
    assert ok_rows(inject_oom) == [32, 32, 32, 4]


def test_tf_tensor_input(inject_oom):
    model = dense_model()
    x = tf.constant(random_data(300))
    inject_oom(50)
    result = safe_predict(model, x, batch_size=200, verbose=0)
    assert_same_result(result, reference(model, x))
    assert inject_oom.ooms
    assert sum(ok_rows(inject_oom)) == 300


def two_input_model(as_dict):
    keras.utils.set_random_seed(3)
    a = keras.Input((4,), name="a")
    b = keras.Input((2,), name="b")
    h = keras.layers.Concatenate()([keras.layers.Dense(5)(a), keras.layers.Dense(5)(b)])
    out = keras.layers.Dense(3)(h)
    return keras.Model({"a": a, "b": b} if as_dict else [a, b], out)


@pytest.mark.parametrize("container", [list, tuple])
def test_list_input_of_multi_input_model(inject_oom, container):
    model = two_input_model(as_dict=False)
    x = container([random_data(300, 4, seed=1), random_data(300, 2, seed=2)])
    inject_oom(60)
    result = safe_predict(model, x, batch_size=300, verbose=0)
    assert_same_result(result, reference(model, x))
    assert inject_oom.ooms
    assert sum(ok_rows(inject_oom)) == 300


def test_dict_input_of_multi_input_model(inject_oom):
    model = two_input_model(as_dict=True)
    x = {"a": random_data(300, 4, seed=1), "b": random_data(300, 2, seed=2)}
    inject_oom(60)
    result = safe_predict(model, x, batch_size=300, verbose=0)
    assert_same_result(result, reference(model, x))
    assert inject_oom.ooms


def test_dict_dataset_of_multi_input_model(inject_oom):
    model = two_input_model(as_dict=True)
    x = {"a": random_data(150, 4, seed=1), "b": random_data(150, 2, seed=2)}
    ds = tf.data.Dataset.from_tensor_slices(x).batch(70)
    inject_oom(20)
    result = safe_predict(model, ds, verbose=0)
    assert_same_result(result, reference(model, ds))
    assert inject_oom.ooms


def multi_output_model(as_dict):
    keras.utils.set_random_seed(4)
    inputs = keras.Input((4,))
    h = keras.layers.Dense(6, activation="tanh")(inputs)
    probs = keras.layers.Dense(5, activation="softmax", name="probs")(h)
    value = keras.layers.Dense(1, name="value")(h)
    outputs = {"probs": probs, "value": value} if as_dict else [probs, value]
    return keras.Model(inputs, outputs)


@pytest.mark.parametrize("as_dict", [False, True], ids=["list", "dict"])
def test_multi_output(inject_oom, as_dict):
    model = multi_output_model(as_dict)
    x = random_data(400)
    inject_oom(70)
    result = safe_predict(model, x, batch_size=300, verbose=0)
    expected = reference(model, x)
    assert isinstance(expected, dict if as_dict else list)
    assert_same_result(result, expected)
    assert inject_oom.ooms


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
    assert sum(ok_rows(inject_oom)) == 250


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
    assert inject_oom.ooms, "the dataset's batches were never too large"
    assert all(rows <= 30 for rows in ok_rows(inject_oom))
    assert sum(ok_rows(inject_oom)) == 250


def test_dataset_row_order_survives_splitting(inject_oom):
    model = identity_model()
    x = rows_data(250)
    ds = tf.data.Dataset.from_tensor_slices(x).batch(100)
    inject_oom(30)
    result = safe_predict(model, ds, verbose=0)
    np.testing.assert_array_equal(result, x)
    assert_same_result(result, reference(model, ds))


class ArrayPyDataset(keras.utils.PyDataset):
    def __init__(self, x, batch_size, with_y=False):
        super().__init__()
        self.x, self.batch_size, self.with_y = x, batch_size, with_y

    def __len__(self):
        return -(-len(self.x) // self.batch_size)

    def __getitem__(self, index):
        batch = self.x[index * self.batch_size:(index + 1) * self.batch_size]
        if self.with_y:
            return batch, np.zeros((len(batch), 1), "float32")
        return batch


@pytest.mark.parametrize("with_y", [False, True], ids=["x", "x_y"])
def test_py_dataset(inject_oom, with_y):
    model = dense_model()
    x = random_data(230)
    data = ArrayPyDataset(x, 90, with_y=with_y)
    inject_oom(25)
    result = safe_predict(model, data, verbose=0)
    assert_same_result(result, reference(model, data))
    assert inject_oom.ooms
    assert sum(ok_rows(inject_oom)) == 230


def batches(x, sizes):
    """A generator of `(x_batch,)` tuples (the form Keras requires)."""
    start = 0
    for size in sizes:
        yield (x[start:start + size],)
        start += size


def test_generator(inject_oom):
    model = dense_model()
    x = random_data(230)
    sizes = [100, 100, 30]
    inject_oom(40)
    result = safe_predict(model, batches(x, sizes), verbose=0)
    assert_same_result(result, reference(model, batches(x, sizes)))
    assert inject_oom.ooms
    assert sum(ok_rows(inject_oom)) == 230


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
    assert inject_oom.ooms


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
    assert inject_oom.ooms


def test_fewer_samples_than_the_batch(inject_oom):
    model = identity_model()
    x = rows_data(10)
    inject_oom(3)
    result = safe_predict(model, x, batch_size=1000, verbose=0)
    np.testing.assert_array_equal(result, x)
    assert sum(ok_rows(inject_oom)) == 10


# ---------------------------------------------------------------------------
# Every row exactly once, in order
# ---------------------------------------------------------------------------
def test_uneven_sizes_every_row_once_in_order(inject_oom):
    model = identity_model()
    x = rows_data(1000)
    inject_oom(70)
    result = safe_predict(model, x, batch_size=300, verbose=0)
    # Outputs map back to inputs row by row: nothing lost, duplicated or moved.
    np.testing.assert_array_equal(result, x)
    assert_same_result(result, reference(model, x))
    # The successful pieces cover the 1000 rows exactly once.
    assert sum(ok_rows(inject_oom)) == 1000
    assert all(rows <= 70 for rows in ok_rows(inject_oom))
    assert inject_oom.ooms and all(rows > 70 for rows in inject_oom.ooms)
    assert all(rows <= 300 for _, rows, _ in inject_oom.calls)


def test_uneven_sizes_pieces_seen_by_model_tile_the_input(fault_at):
    # Content-level check: the rows each successful step received, in order,
    # are exactly 0..n-1, each once.
    model = identity_model()
    n = 1000
    x = rows_data(n)
    fault_at(poison=600, max_rows=70)
    result = safe_predict(model, x, batch_size=300, verbose=0)
    seen = [i for piece in fault_at.pieces for i in piece]
    assert seen == list(range(n))
    assert fault_at.failed, "the poisoned row never caused an OOM"
    np.testing.assert_array_equal(result, x)


@pytest.mark.parametrize(
    "poison", [0, 500, 1025], ids=["first piece", "middle", "last partial piece"]
)
def test_oom_on_first_middle_and_last_partial_piece(fault_at, poison):
    # 1030 rows in batches of 100: the last piece holds only 30 rows.
    model = identity_model()
    n = 1030
    x = rows_data(n)
    fault_at(poison=poison, max_rows=20)
    result = safe_predict(model, x, batch_size=100, verbose=0)
    np.testing.assert_array_equal(result, x)
    assert_same_result(result, reference(model, x))
    seen = [i for piece in fault_at.pieces for i in piece]
    assert seen == list(range(n))
    assert fault_at.failed
    assert all(poison in ids for ids in fault_at.failed)
    if poison == 1025:
        assert fault_at.failed[0] == list(range(1000, 1030))  # the partial piece
    if poison == 0:
        assert fault_at.failed[0] == list(range(100))  # the very first piece


def test_oom_on_first_piece(inject_oom):
    model = dense_model()
    x = random_data(250)
    inject_oom(45)
    result = safe_predict(model, x, batch_size=100, verbose=0)
    assert_same_result(result, reference(model, x))
    assert inject_oom.calls[0] == ("predict", 100, True)


def test_oom_in_the_middle_of_a_generator(inject_oom):
    model = identity_model()
    x = rows_data(140)
    sizes = [20, 20, 80, 20]
    inject_oom(50)
    result = safe_predict(model, batches(x, sizes), verbose=0)
    np.testing.assert_array_equal(result, x)
    assert_same_result(result, reference(model, batches(x, sizes)))
    assert inject_oom.ooms == [80]
    # The first 40 rows ran before the OOM, the rest after it.
    first_oom = [raised for _, _, raised in inject_oom.calls].index(True)
    assert sum(rows for _, rows, _ in inject_oom.calls[:first_oom]) == 40


def test_oom_raised_after_the_step_ran_discards_its_result(inject_oom):
    model = identity_model()
    x = rows_data(500)
    inject_oom(60, after=True)
    result = safe_predict(model, x, batch_size=256, verbose=0)
    np.testing.assert_array_equal(result, x)
    assert_same_result(result, reference(model, x))
    assert inject_oom.ooms
    assert sum(ok_rows(inject_oom)) == 500


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
    assert inject_oom.ooms


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
    assert inject_oom.ooms


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
    assert inject_oom.ooms


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
    assert ok_rows(inject_oom) == [20, 20, 10]


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
def test_batch_size_with_batched_input(inject_oom, kind):
    x = random_data(40)
    data = {
        "dataset": lambda: tf.data.Dataset.from_tensor_slices(x).batch(10),
        "generator": lambda: batches(x, [10, 30]),
        "py_dataset": lambda: ArrayPyDataset(x, 10),
    }[kind]()
    inject_oom(None)
    with pytest.raises(ValueError) as excinfo:
        safe_predict(dense_model(), data, batch_size=16, verbose=0)
    message = str(excinfo.value)
    assert "batch_size=16" in message
    assert "max_batch_size" in message
    assert inject_oom.calls == []


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
# Empty input, steps, max_batch_size
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


def test_steps_with_arrays(inject_oom):
    model = dense_model()
    x = random_data(100)
    inject_oom(None)
    result = safe_predict(model, x, batch_size=10, steps=3, verbose=0)
    expected = model.predict(x, batch_size=10, steps=3, verbose=0)
    assert expected.shape == (30, 3)
    assert_same_result(result, expected)
    assert sum(ok_rows(inject_oom)) == 30


def test_steps_with_arrays_under_oom(inject_oom):
    model = identity_model()
    x = rows_data(100)
    inject_oom(4)
    result = safe_predict(model, x, batch_size=10, steps=3, verbose=0)
    np.testing.assert_array_equal(result, x[:30])
    assert sum(ok_rows(inject_oom)) == 30


def test_steps_with_an_infinite_dataset(inject_oom):
    model = identity_model()
    x = rows_data(50)
    ds = tf.data.Dataset.from_tensor_slices(x).batch(20).repeat()
    inject_oom(8)
    result = safe_predict(model, ds, steps=4, verbose=0)
    expected = np.concatenate([x[:20], x[20:40], x[40:50], x[:20]])
    np.testing.assert_array_equal(result, expected)
    assert_same_result(result, model.predict(ds, steps=4, verbose=0))


def test_steps_with_dataset(inject_oom):
    model = dense_model()
    x = random_data(100)
    ds = tf.data.Dataset.from_tensor_slices(x).batch(30)
    inject_oom(12)
    result = safe_predict(model, ds, steps=2, verbose=0)
    expected = model.predict(ds, steps=2, verbose=0)
    assert expected.shape == (60, 3)
    assert_same_result(result, expected)
    assert sum(ok_rows(inject_oom)) == 60


def test_max_batch_size_bounds_every_piece_of_arrays(inject_oom):
    model = dense_model()
    x = random_data(500)
    inject_oom(None)
    result = safe_predict(model, x, batch_size=400, max_batch_size=45, verbose=0)
    assert_same_result(result, reference(model, x))
    assert inject_oom.calls
    assert all(rows <= 45 for _, rows, _ in inject_oom.calls)
    assert sum(ok_rows(inject_oom)) == 500


def test_max_batch_size_bounds_every_piece_of_a_dataset(inject_oom):
    model = identity_model()
    x = rows_data(500)
    ds = tf.data.Dataset.from_tensor_slices(x).batch(200)
    inject_oom(None)
    result = safe_predict(model, ds, max_batch_size=45, verbose=0)
    np.testing.assert_array_equal(result, x)
    assert all(rows <= 45 for _, rows, _ in inject_oom.calls)
    assert sum(ok_rows(inject_oom)) == 500


def test_max_batch_size_with_default_batch_size(inject_oom):
    model = dense_model()
    x = random_data(100)
    inject_oom(None)
    safe_predict(model, x, max_batch_size=10, verbose=0)
    assert ok_rows(inject_oom) == [10] * 10


# ---------------------------------------------------------------------------
# Callbacks and verbosity
# ---------------------------------------------------------------------------
class Recorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.events = []

    def on_predict_begin(self, logs=None):
        self.events.append(("begin", None, None))

    def on_predict_batch_end(self, batch, logs=None):
        rows = int(keras.tree.flatten(logs["outputs"])[0].shape[0])
        self.events.append(("batch_end", batch, rows))

    def on_predict_end(self, logs=None):
        self.events.append(("end", None, None))


def test_callbacks_receive_one_batch_end_per_piece(inject_oom):
    model = dense_model()
    x = random_data(400)
    recorder = Recorder()
    inject_oom(60)
    result = safe_predict(model, x, batch_size=300, callbacks=[recorder], verbose=0)
    assert_same_result(result, reference(model, x))
    events = recorder.events
    assert events[0] == ("begin", None, None)
    assert events[-1] == ("end", None, None)
    batch_ends = [e for e in events if e[0] == "batch_end"]
    assert [rows for _, _, rows in batch_ends] == ok_rows(inject_oom)
    assert [batch for _, batch, _ in batch_ends] == list(range(len(batch_ends)))
    assert inject_oom.ooms  # the failed pieces got no batch_end
    assert recorder.model is model


def test_callback_batch_begin_and_end_are_paired(inject_oom):
    # Keras calls on_predict_batch_begin(i) then on_predict_batch_end(i) once
    # per batch; a retried piece must not send a second begin for batch i
    # (a timing or profiling callback would be thrown off).
    model = dense_model()
    x = random_data(200)

    class Pairs(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.log = []

        def on_predict_batch_begin(self, batch, logs=None):
            self.log.append(("begin", batch))

        def on_predict_batch_end(self, batch, logs=None):
            self.log.append(("end", batch))

    pairs = Pairs()
    inject_oom(30)
    safe_predict(model, x, batch_size=100, callbacks=[pairs], verbose=0)
    assert inject_oom.ooms
    ends = [b for kind, b in pairs.log if kind == "end"]
    expected = [entry for b in ends for entry in (("begin", b), ("end", b))]
    assert pairs.log == expected


def test_callback_can_stop_prediction(inject_oom):
    model = dense_model()
    x = random_data(100)

    class Stop(keras.callbacks.Callback):
        def on_predict_batch_end(self, batch, logs=None):
            if batch == 1:
                self.model.stop_predicting = True

    inject_oom(None)
    result = safe_predict(model, x, batch_size=20, callbacks=[Stop()], verbose=0)
    expected = reference(model, x)
    assert_same_result(result, expected[:40])


def test_verbose_1_prints_a_progress_bar(inject_oom, capsys):
    model = dense_model()
    x = random_data(120)
    inject_oom(None)
    capsys.readouterr()
    safe_predict(model, x, batch_size=50, verbose=1)
    out = capsys.readouterr().out
    assert "120/120" in out
    assert "━" in out  # Keras's progress bar


def test_verbose_1_under_oom_reaches_the_total(inject_oom, capsys):
    model = dense_model()
    inject_oom(30)
    capsys.readouterr()
    safe_predict(model, random_data(120), batch_size=100, verbose=1)
    assert "120/120" in capsys.readouterr().out
    assert inject_oom.ooms


def test_verbose_auto_prints_a_progress_bar(inject_oom, capsys):
    model = dense_model()
    inject_oom(None)
    capsys.readouterr()
    safe_predict(model, random_data(70), batch_size=50)
    assert "70/70" in capsys.readouterr().out


def test_verbose_2_prints_one_line_at_the_end(inject_oom, capsys):
    model = dense_model()
    inject_oom(None)
    capsys.readouterr()
    safe_predict(model, random_data(70), batch_size=10, verbose=2)
    out = capsys.readouterr().out
    assert "70/70" in out
    assert "━" not in out


def test_verbose_0_prints_nothing(inject_oom, capsys):
    model = dense_model()
    inject_oom(40)
    capsys.readouterr()
    safe_predict(model, random_data(120), batch_size=100, verbose=0)
    assert capsys.readouterr().out == ""
    assert inject_oom.ooms


def test_verbose_1_with_dataset_finishes_the_bar(inject_oom, capsys):
    model = dense_model()
    ds = tf.data.Dataset.from_tensor_slices(random_data(90)).batch(40)
    inject_oom(None)
    capsys.readouterr()
    safe_predict(model, ds, verbose=1)
    assert "90" in capsys.readouterr().out


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
        if rows is not None and rows > self.limit:
            err = ValueError(f"batch of {rows} rows is too large for this layer")
            FailsAbove.raised.append(err)
            raise err
        return x * 2.0


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
    original = tf.errors.InvalidArgumentError(None, None, "Matrix size-incompatible")
    state = raising_step(original, above=0)
    with pytest.raises(tf.errors.InvalidArgumentError) as excinfo:
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
    assert inject_oom.ooms == [50]


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
    assert isinstance(err, tf.errors.ResourceExhaustedError)
    assert err.model_name == "too_big"
    assert err.phase == "predict"
    assert err.batch_shape == ((1, 4),)
    assert err.device == "CPU:0"
    assert isinstance(err.__cause__, tf.errors.ResourceExhaustedError)
    assert not isinstance(err.__cause__, OutOfMemoryError)
    assert "injected" in str(err.__cause__)
    assert inject_oom.ooms[-1] == 1
    assert all(raised for _, _, raised in inject_oom.calls)


def test_single_sample_failing_in_a_dataset(inject_oom):
    model = dense_model(name="too_big_ds")
    ds = tf.data.Dataset.from_tensor_slices(random_data(30)).batch(10)
    inject_oom(0)
    with pytest.raises(OutOfMemoryError) as excinfo:
        safe_predict(model, ds, verbose=0)
    assert excinfo.value.batch_shape == ((1, 4),)


# ---------------------------------------------------------------------------
# Memory across calls, logging
# ---------------------------------------------------------------------------
def test_second_call_does_not_pay_the_oom_again(inject_oom):
    model = dense_model()
    x = random_data(1000)
    inject_oom(70)
    first = safe_predict(model, x, batch_size=300, verbose=0)
    assert inject_oom.ooms, "the first call should have hit the injected OOM"
    before = len(inject_oom.calls)
    second = safe_predict(model, x, batch_size=300, verbose=0)
    second_calls = inject_oom.calls[before:]
    assert [rows for _, rows, raised in second_calls if raised] == []
    assert sum(rows for _, rows, _ in second_calls) == 1000
    assert_same_result(second, first)
    assert_same_result(second, reference(model, x))


def test_second_call_with_other_length_same_signature_pays_no_oom(inject_oom):
    model = dense_model()
    inject_oom(50)
    safe_predict(model, random_data(400), batch_size=200, verbose=0)
    assert inject_oom.ooms
    before = len(inject_oom.calls)
    x = random_data(333, seed=7)
    result = safe_predict(model, x, batch_size=200, verbose=0)
    assert not any(raised for _, _, raised in inject_oom.calls[before:])
    assert_same_result(result, reference(model, x))


def test_warning_names_failed_and_new_batch_size(inject_oom, caplog):
    model = dense_model()
    x = random_data(300)
    inject_oom(60)
    with caplog.at_level(logging.WARNING, logger="keras_memfit"):
        safe_predict(model, x, batch_size=100, verbose=0)
    records = [r for r in caplog.records
               if r.name == "keras_memfit" and r.levelno == logging.WARNING]
    assert records, "no WARNING was logged for the OOM"
    message = records[0].getMessage()
    failed = inject_oom.ooms[0]
    assert failed == 100
    # The size tried next is the one the warning announces.
    index = [c[1:] for c in inject_oom.calls].index((failed, True))
    retried = inject_oom.calls[index + 1][1]
    sizes = [int(s) for s in re.findall(r"batch_size=(\d+)", message)]
    assert sizes == [failed, retried], message
    assert len(records) == len(inject_oom.ooms)


def test_no_warning_without_oom(inject_oom, caplog):
    inject_oom(None)
    with caplog.at_level(logging.WARNING, logger="keras_memfit"):
        safe_predict(dense_model(), random_data(100), batch_size=50, verbose=0)
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_cached_steps_do_not_keep_a_deleted_model_alive():
    import gc

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    safe_predict(model, np.zeros((8, 4), "float32"), verbose=0)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_repeated_calls_reuse_the_compiled_step(monkeypatch):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    x = np.random.default_rng(0).normal(size=(40, 4)).astype("float32")
    built = []
    make = tf_backend.make_predict_step

    def counting(model, postprocess=None):
        built.append(1)
        return make(model, postprocess)

    monkeypatch.setattr(tf_backend, "make_predict_step", counting)
    _cache.clear()
    first = safe_predict(model, x, batch_size=16, verbose=0)
    second = safe_predict(model, x, batch_size=16, verbose=0)
    assert len(built) == 1
    np.testing.assert_allclose(second, first)
    np.testing.assert_allclose(first, model.predict(x, batch_size=8, verbose=0), rtol=1e-5, atol=1e-6)
