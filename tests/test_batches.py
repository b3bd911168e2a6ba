"""Unit tests of keras_memfit._internal.batches: what MemFit can split, checked on every batch.

`splittable_rows` is the one-pass form of `unsplittable` and `data.num_rows`
used in MemFit's per-batch path; those two are the reference. Any backend.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

from keras_memfit._internal import batches as _batches


def _chunks():
    x = np.zeros((6, 3), "float32")
    y = np.zeros((6,), "int32")
    return {
        "arrays": (x, y, None),
        "x only": (x, None, None),
        "dict of inputs": ({"a": x, "b": np.zeros((6, 2, 2))}, y, np.ones((6,))),
        "nested lists": ([x, {"c": np.zeros((6,))}], None, None),
        "tensors": (keras.ops.zeros((5, 2)), keras.ops.zeros((5,)), None),
        "None inputs first": ({"a": None, "b": x}, None, None),
        "nothing": (None, None, None),
        "a scalar leaf": (x, np.float32(1.0), None),
        "a 0-d array": (x, np.zeros(()), None),
        "a python list of numbers": (x, [1, 2, 3, 4, 5, 6], None),
    }


@pytest.mark.parametrize("name", list(_chunks()))
def test_splittable_rows_agrees_with_unsplittable_and_num_rows(name):
    chunk = _chunks()[name]
    rows = _batches.splittable_rows(chunk)
    if _batches.unsplittable(chunk) is not None:
        assert rows is None
    else:
        assert rows == _batches.num_rows(chunk)


def test_splittable_rows_reads_the_rows_and_refuses_what_cannot_be_split():
    x = np.zeros((6, 3), "float32")
    assert _batches.splittable_rows((x, np.zeros((6,)), None)) == 6
    assert _batches.splittable_rows(({"a": None, "b": x[:4]}, None, None)) == 4
    assert _batches.splittable_rows((None, None, None)) == 0
    assert _batches.splittable_rows((x, np.zeros(()), None)) is None
    assert _batches.splittable_rows((x, "labels", None)) is None


@pytest.mark.parametrize("name", list(_chunks()))
def test_leaves_are_keras_tree_leaves_before_and_after_a_class_is_remembered(name):
    chunk = _chunks()[name]
    for _ in range(2):  # the first check may remember a dense class (`_DENSE_CLASSES`)
        _batches.splittable_rows(chunk)
        got = _batches.leaves(chunk)
        expected = keras.tree.flatten(chunk)
        assert len(got) == len(expected)
        assert all(a is b for a, b in zip(got, expected))
