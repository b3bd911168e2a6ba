"""Sparse batches Keras takes, `safe_predict` and `safe_evaluate` take too.

Keras's own test suite (`trainer_test.py::test_{predict,evaluate}_sparse_*`)
feeds a generator of sparse batches: scipy sparse matrices, JAX `BCOO`
arrays and `tf.SparseTensor`s, to a model whether or not it runs eagerly.
Keras's data adapters turn each into the backend's own sparse type; so must
the drop-ins. The reference is plain `model.predict` / `model.evaluate` on
the same batches.
"""

from __future__ import annotations

import importlib.util

import keras
import numpy as np
import pytest

from keras_memfit import safe_evaluate, safe_predict
from support import BACKEND

scipy_sparse = pytest.importorskip("scipy.sparse")

FORMATS = ("coo", "csr", "csc", "bsr", "lil", "dok", "dia")
HAS_JAX = importlib.util.find_spec("jax") is not None
HAS_TF = importlib.util.find_spec("tensorflow") is not None


class SparseModel(keras.Model):
    """Keras's `ExampleModel` of those tests: one Dense(3) of ones on 4 features."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(3, kernel_initializer="ones", use_bias=False)

    def call(self, x):
        return self.dense(x)


def _batches(kind: str):
    """Four (x, y) batches of 2 rows; x sparse of `kind` ("scipy-<format>", "jax", "tf")."""
    for i in range(4):
        dense = np.eye(2, 4, k=i % 3, dtype="float32") * (i + 1)
        if kind.startswith("scipy-"):
            x = getattr(scipy_sparse.coo_matrix(dense), "to" + kind[len("scipy-"):])()
        elif kind == "jax":
            import jax.experimental.sparse as jax_sparse

            x = jax_sparse.BCOO.fromdense(dense)
        else:
            import tensorflow as tf

            x = tf.sparse.from_dense(dense)
        y = np.random.default_rng(i).random((2, 3), dtype=np.float32)
        yield x, y


KINDS = [f"scipy-{f}" for f in FORMATS] + [
    pytest.param("jax", marks=pytest.mark.skipif(not HAS_JAX, reason="jax not installed")),
    pytest.param("tf", marks=pytest.mark.skipif(not HAS_TF, reason="tensorflow not installed")),
]


def _model(eager: bool) -> keras.Model:
    model = SparseModel()
    model.compile(optimizer="adagrad", loss="mse", metrics=["mse"],
                  run_eagerly=eager, jit_compile=False)
    return model


@pytest.mark.skipif(BACKEND not in ("tensorflow", "jax"),
                    reason=f"Keras has no sparse tensors on {BACKEND}")
@pytest.mark.parametrize("eager", [False, True], ids=["graph", "eager"])
@pytest.mark.parametrize("kind", KINDS)
def test_sparse_batches_predict_and_evaluate_as_keras(kind, eager):
    model = _model(eager)
    expected = model.predict(_batches(kind), verbose=0)
    got = safe_predict(model, _batches(kind), verbose=0)
    assert type(got) is type(expected) and got.shape == expected.shape == (8, 3)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    expected_logs = model.evaluate(_batches(kind), verbose=0, return_dict=True)
    logs = safe_evaluate(model, _batches(kind), verbose=0, return_dict=True)
    assert set(logs) == set(expected_logs)
    for name, value in expected_logs.items():
        np.testing.assert_allclose(logs[name], value, rtol=1e-6, err_msg=name)


@pytest.mark.skipif(BACKEND not in ("tensorflow", "jax"),
                    reason=f"Keras has no sparse tensors on {BACKEND}")
@pytest.mark.parametrize("fmt", ["csr", "coo"])
def test_a_scipy_matrix_as_x_is_batched_as_keras_batches_it(fmt):
    x = getattr(scipy_sparse.random(100, 4, density=0.3, dtype="float32", random_state=0,
                                    format="csr"), "to" + fmt)()
    if fmt == "coo" and BACKEND == "tensorflow":
        x.sum_duplicates()  # Keras's TensorFlow slicing needs sorted indices (canonical)
    y = np.random.default_rng(0).random((100, 3), dtype=np.float32)
    model = keras.Sequential([keras.Input((4,), sparse=True), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss="mse")
    np.testing.assert_allclose(safe_predict(model, x, batch_size=16, verbose=0),
                               model.predict(x, batch_size=16, verbose=0), rtol=1e-6)
    np.testing.assert_allclose(safe_evaluate(model, x, y, batch_size=16, verbose=0),
                               model.evaluate(x, y, batch_size=16, verbose=0), rtol=1e-6)
