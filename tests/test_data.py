"""Unit tests of keras_memfit.planning.data: turning predict/evaluate inputs into chunks of rows."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_memfit._internal import batches
from keras_memfit.planning import data
from support import Batches


def _arange(n, width=3, dtype="float32"):
    return np.arange(n * width, dtype=dtype).reshape(n, width)


# --------------------------------------------------------------------------
# is_array_like
# --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value",
    [
        np.zeros((4, 2)),
        tf.zeros((4, 2)),
        [np.zeros((4, 2)), np.zeros((4, 1))],
        (np.zeros((4, 2)), np.zeros((4,))),
        {"a": np.zeros((4, 2)), "b": tf.zeros((4, 3))},
        {"a": [np.zeros((4, 2)), {"c": np.zeros((4,))}]},
        (np.zeros((4, 2)), None),
    ],
    ids=["ndarray", "tensor", "list", "tuple", "dict", "nested", "with-none"],
)
def test_is_array_like_accepts_arrays_tensors_and_structures(value):
    assert data.is_array_like(value) is True


@pytest.mark.parametrize(
    "value",
    [
        None,
        [],
        {},
        [None, None],
        "abc",
        5,
        [1.0, 2.0],
        [np.zeros((4, 2)), "abc"],
        tf.data.Dataset.from_tensor_slices(np.zeros((4, 2))).batch(2),
        (i for i in range(3)),
    ],
    ids=["none", "empty-list", "empty-dict", "only-none", "str", "int", "floats",
         "array-and-str", "dataset", "generator"],
)
def test_is_array_like_rejects_everything_else(value):
    assert data.is_array_like(value) is False


# --------------------------------------------------------------------------
# num_rows / rows / signature / shapes
# --------------------------------------------------------------------------
def test_num_rows_reads_the_leading_dimension():
    assert batches.num_rows(np.zeros((7, 3))) == 7
    assert batches.num_rows(tf.zeros((5, 2))) == 5
    assert batches.num_rows((None, np.zeros((6,)), None)) == 6
    assert batches.num_rows({"a": np.zeros((3, 1)), "b": np.zeros((3, 4))}) == 3
    assert batches.num_rows((np.zeros((0, 3)),)) == 0


def test_num_rows_of_nothing_is_zero():
    assert batches.num_rows((None, None)) == 0


@pytest.mark.parametrize("leaf", [np.float32(1.0), np.array(3.0), 4], ids=["np-scalar", "0d", "int"])
def test_num_rows_without_batch_dimension_raises(leaf):
    with pytest.raises(ValueError, match="batch dimension"):
        batches.num_rows((leaf,))


def test_rows_are_numpy_views_in_every_leaf():
    x = _arange(10)
    y = np.arange(10)
    chunk = ({"a": x, "b": [x[:, :1]]}, y, None)
    piece = batches.rows(chunk, 3, 7)
    assert piece[2] is None
    np.testing.assert_array_equal(piece[0]["a"], x[3:7])
    np.testing.assert_array_equal(piece[0]["b"][0], x[3:7, :1])
    np.testing.assert_array_equal(piece[1], y[3:7])
    # Views: no copy, sharing the caller's buffer.
    assert np.shares_memory(piece[0]["a"], x)
    assert np.shares_memory(piece[1], y)
    assert piece[0]["a"].base is not None


def test_rows_clips_past_the_end_and_slices_tensors():
    x = tf.constant(_arange(5))
    piece = batches.rows((x,), 3, 10)
    assert tf.is_tensor(piece[0])
    np.testing.assert_array_equal(piece[0].numpy(), _arange(5)[3:])


def test_signature_ignores_the_batch_dimension():
    a = batches.signature((np.zeros((10, 3, 2), "float32"), np.zeros((10,), "int64")))
    b = batches.signature((np.zeros((1, 3, 2), "float32"), np.zeros((1,), "int64")))
    assert a == b
    assert a == (((3, 2), "float32"), ((), "int64"))
    hash(a)  # usable as a dict key


def test_signature_tells_shapes_dtypes_and_structure_apart():
    base = batches.signature(np.zeros((4, 3), "float32"))
    assert batches.signature(np.zeros((4, 4), "float32")) != base
    assert batches.signature(np.zeros((4, 3), "float64")) != base
    assert batches.signature([np.zeros((4, 3), "float32")] * 2) != base


def test_signature_of_a_tensor_equals_that_of_an_array_of_the_same_dtype():
    # The planner remembers what fitted per signature: calling with a
    # tf.Tensor and then with the same data as numpy must share that record.
    assert batches.signature(tf.zeros((9, 3), tf.float32)) == batches.signature(
        np.zeros((4, 3), "float32")
    )


def test_signature_skips_none_leaves_and_handles_dicts():
    sig = batches.signature({"a": np.zeros((2, 5), "float32"), "b": None})
    assert sig == (((5,), "float32"),)


def test_shapes_lists_non_none_leaves():
    assert batches.shapes((np.zeros((1, 3)), None, np.zeros((1,)))) == ((1, 3), (1,))


# --------------------------------------------------------------------------
# from_input: arrays
# --------------------------------------------------------------------------
def test_arrays_are_one_chunk_holding_every_sample():
    x, y, w = _arange(10), np.arange(10), np.linspace(0, 1, 10)
    source = data.from_input(x, y, w, batch_size=4, steps=None, with_targets=True)
    assert source.from_arrays is True
    assert source.num_samples == 10
    chunks = list(source.chunks)
    assert len(chunks) == 1
    cx, cy, cw = chunks[0]
    np.testing.assert_array_equal(cx, x)
    np.testing.assert_array_equal(cy, y)
    np.testing.assert_array_equal(cw, w)


def test_arrays_without_targets_for_predict():
    x = _arange(6)
    chunks = list(data.from_input(x, batch_size=None, steps=None, with_targets=False).chunks)
    assert len(chunks) == 1
    assert len(chunks[0]) == 1
    np.testing.assert_array_equal(chunks[0][0], x)


def test_arrays_with_targets_but_no_y_or_weights():
    x = _arange(6)
    (chunk,) = data.from_input(x, batch_size=None, steps=None, with_targets=True).chunks
    assert chunk[1] is None and chunk[2] is None


def test_array_dict_inputs_keep_their_structure():
    x = {"a": _arange(5), "b": np.ones((5, 2))}
    (chunk,) = data.from_input(x, np.zeros(5), batch_size=2, steps=None, with_targets=True).chunks
    assert set(chunk[0]) == {"a", "b"}
    assert batches.num_rows(chunk) == 5


def test_tensor_input_is_kept_as_a_tensor():
    x = keras.ops.convert_to_tensor(_arange(4))  # the active backend's tensor
    (chunk,) = data.from_input(x, batch_size=None, steps=None, with_targets=False).chunks
    assert chunk[0] is x


def test_tf_tensor_input_is_read_as_an_array_on_another_backend():
    x = tf.constant(_arange(4))
    (chunk,) = data.from_input(x, batch_size=None, steps=None, with_targets=False).chunks
    if keras.backend.backend() == "tensorflow":
        assert chunk[0] is x
    else:  # as Keras's own array adapter reads it there
        assert isinstance(chunk[0], np.ndarray)
    np.testing.assert_array_equal(np.asarray(chunk[0]), _arange(4))


@pytest.mark.parametrize(
    "steps, batch_size, expected",
    [(2, 3, 6), (1, 10, 10), (5, 10, 25), (100, 10, 25), (1, None, 25)],
)
def test_steps_times_batch_size_truncates_arrays(steps, batch_size, expected):
    x, y = _arange(25), np.arange(25)
    source = data.from_input(x, y, batch_size=batch_size, steps=steps, with_targets=True)
    assert source.num_samples == expected
    (chunk,) = source.chunks
    assert batches.num_rows(chunk) == expected
    np.testing.assert_array_equal(chunk[0], x[:expected])
    np.testing.assert_array_equal(chunk[1], y[:expected])


def test_steps_uses_keras_default_batch_size_of_32():
    x = _arange(100)
    source = data.from_input(x, batch_size=None, steps=2, with_targets=False)
    assert data.DEFAULT_BATCH_SIZE == 32
    assert source.num_samples == 64


def test_mismatched_lengths_raise_naming_the_sizes():
    with pytest.raises(ValueError, match=r"\[10, 12\]"):
        data.from_input(_arange(10), np.arange(12), batch_size=None, steps=None,
                        with_targets=True)


def test_mismatched_sample_weight_length_raises():
    with pytest.raises(ValueError, match=r"\[8, 10\]"):
        data.from_input(_arange(10), np.arange(10), np.ones(8), batch_size=None,
                        steps=None, with_targets=True)


def test_mismatched_input_leaves_raise():
    with pytest.raises(ValueError, match=r"\[3, 4\]"):
        data.from_input([_arange(3), _arange(4)], batch_size=None, steps=None,
                        with_targets=False)


def test_pandas_dataframe_is_converted_to_numpy():
    pd = pytest.importorskip("pandas")
    frame = pd.DataFrame({"a": [1.0, 2.0, 3.0], "b": [4.0, 5.0, 6.0]})
    series = pd.Series([0, 1, 0])
    assert data.is_array_like(frame)
    (chunk,) = data.from_input(frame, series, batch_size=None, steps=None,
                               with_targets=True).chunks
    assert isinstance(chunk[0], np.ndarray) and isinstance(chunk[1], np.ndarray)
    np.testing.assert_array_equal(chunk[0], frame.to_numpy())


# --------------------------------------------------------------------------
# from_input: datasets, generators, PyDataset
# --------------------------------------------------------------------------
def _dataset(n=10, batch=4, weights=False):
    x, y = _arange(n), np.arange(n)
    parts = (x, y, np.linspace(0.5, 1.5, n).astype("float32")) if weights else (x, y)
    return tf.data.Dataset.from_tensor_slices(parts).batch(batch), parts


def test_dataset_yields_one_chunk_per_batch_in_order():
    ds, (x, y) = _dataset()
    source = data.from_input(ds, batch_size=None, steps=None, with_targets=True)
    assert source.from_arrays is False
    assert source.num_samples is None
    chunks = list(source.chunks)
    assert [batches.num_rows(c) for c in chunks] == [4, 4, 2]
    np.testing.assert_array_equal(np.concatenate([c[0] for c in chunks]), x)
    np.testing.assert_array_equal(np.concatenate([c[1] for c in chunks]), y)
    assert all(c[2] is None for c in chunks)


def test_dataset_with_sample_weights_unpacks_three_parts():
    ds, (x, y, w) = _dataset(weights=True)
    chunks = list(data.from_input(ds, batch_size=None, steps=None, with_targets=True).chunks)
    np.testing.assert_allclose(np.concatenate([c[2] for c in chunks]), w)
    np.testing.assert_array_equal(np.concatenate([c[1] for c in chunks]), y)


def test_dataset_for_predict_keeps_only_x():
    ds, (x, _) = _dataset()
    chunks = list(data.from_input(ds, batch_size=None, steps=None, with_targets=False).chunks)
    assert all(len(c) == 1 for c in chunks)
    np.testing.assert_array_equal(np.concatenate([c[0] for c in chunks]), x)


def test_x_only_dataset_with_targets_has_no_y():
    ds = tf.data.Dataset.from_tensor_slices(_arange(5)).batch(2)
    chunks = list(data.from_input(ds, batch_size=None, steps=None, with_targets=True).chunks)
    assert [batches.num_rows(c) for c in chunks] == [2, 2, 1]
    assert all(c[1] is None and c[2] is None for c in chunks)


@pytest.mark.parametrize("steps, expected", [(1, [4]), (2, [4, 4]), (3, [4, 4, 2]), (9, [4, 4, 2])])
def test_steps_limits_the_number_of_dataset_batches(steps, expected):
    ds, _ = _dataset()
    chunks = list(data.from_input(ds, batch_size=None, steps=steps, with_targets=True).chunks)
    assert [batches.num_rows(c) for c in chunks] == expected


def test_steps_stops_an_infinite_dataset():
    ds, _ = _dataset()
    chunks = list(data.from_input(ds.repeat(), batch_size=None, steps=5, with_targets=True).chunks)
    assert [batches.num_rows(c) for c in chunks] == [4, 4, 2, 4, 4]


def test_generator_yields_one_chunk_per_item():
    def gen():
        for i in range(3):
            yield np.full((i + 2, 2), i, "float32"), np.full((i + 2,), i)

    chunks = list(data.from_input(gen(), batch_size=None, steps=None, with_targets=True).chunks)
    assert [batches.num_rows(c) for c in chunks] == [2, 3, 4]
    assert [int(c[1][0]) for c in chunks] == [0, 1, 2]


def test_steps_stops_an_infinite_generator():
    def forever():
        i = 0
        while True:
            yield (np.full((3, 1), i, "float32"),)
            i += 1

    chunks = list(data.from_input(forever(), batch_size=None, steps=4, with_targets=False).chunks)
    assert [int(c[0][0, 0]) for c in chunks] == [0, 1, 2, 3]


def _batches(n=11, batch=4):
    """A PyDataset of `(x, y)` batches: 11 rows in batches of 4, 4 and 3."""
    return Batches(_arange(n), np.arange(n), batch_size=batch)


def test_pydataset_yields_one_chunk_per_batch_in_order():
    ds = _batches()
    source = data.from_input(ds, batch_size=None, steps=None, with_targets=True)
    assert source.from_arrays is False
    chunks = list(source.chunks)
    assert [batches.num_rows(c) for c in chunks] == [4, 4, 3]
    np.testing.assert_array_equal(np.concatenate([c[0] for c in chunks]), ds.x)
    np.testing.assert_array_equal(np.concatenate([c[1] for c in chunks]), ds.y)


def test_pydataset_steps_limit():
    chunks = list(data.from_input(_batches(), batch_size=None, steps=2, with_targets=True).chunks)
    assert [batches.num_rows(c) for c in chunks] == [4, 4]


def test_chunks_are_lazy():
    pulled = []

    def gen():
        for i in range(6):
            pulled.append(i)
            yield (np.zeros((2, 1), "float32"),)

    source = data.from_input(gen(), batch_size=None, steps=None, with_targets=False)
    assert pulled == []
    next(source.chunks)
    # Keras's generator adapter peeks at the first batch; nothing more is read.
    assert pulled in ([0], [0, 1])


@pytest.mark.parametrize("name", ["y", "sample_weight"])
def test_targets_or_weights_with_a_dataset_raise(name):
    ds, _ = _dataset()
    kwargs = {"y": None, "sample_weight": None, name: np.ones(10)}
    with pytest.raises(ValueError, match=name):
        data.from_input(ds, kwargs["y"], kwargs["sample_weight"], batch_size=None,
                        steps=None, with_targets=True)


def test_targets_with_a_generator_raise():
    gen = ((np.zeros((2, 1)),) for _ in range(2))
    with pytest.raises(ValueError, match="generator"):
        data.from_input(gen, np.ones(4), batch_size=None, steps=None, with_targets=True)


@pytest.mark.parametrize("value", ["abc", 5, object()], ids=["str", "int", "object"])
def test_unsupported_input_raises_type_error_naming_the_type(value):
    with pytest.raises(TypeError, match=type(value).__name__):
        list(data.from_input(value, batch_size=None, steps=None, with_targets=False).chunks)
