"""A model whose outputs couple the rows of a batch, and what Keras's own results are.

keras-io's collaborative-filtering `RecommenderNet` scores a batch with
`ops.tensordot(user, movie, 2)`, which sums over the batch axis too: a row's
output depends on the other rows of its batch, so plain Keras gives other
results at another batch_size and no split can give the unsplit batch's.
MemFit logs one WARNING naming such a model the first time it splits a batch
(OOMs injected with `inject_oom`), nothing for a model whose rows are
independent. With no pressure, `safe_predict`/`safe_evaluate` run Keras's
batches, so even such a model gets Keras's values (bitwise on JAX and torch;
on TensorFlow the predict step, traced once for every batch size, may round
differently, docs/inference.md "What they guarantee").
"""

from __future__ import annotations

import logging

import keras
import numpy as np
import pytest
from keras import ops
from support import BACKEND

from keras_memfit import MemFit, safe_evaluate, safe_predict

USERS, MOVIES = 50, 40
COUPLING = "couples the rows of a batch"


class Recommender(keras.Model):
    """keras-io's RecommenderNet, small: the dot product sums over the batch too."""

    def __init__(self, per_row=False, **kwargs):
        super().__init__(**kwargs)
        self.per_row = per_row
        init = keras.initializers.RandomNormal(stddev=0.5)
        self.user = keras.layers.Embedding(USERS, 8, embeddings_initializer=init)
        self.movie = keras.layers.Embedding(MOVIES, 8, embeddings_initializer=init)
        self.user_bias = keras.layers.Embedding(USERS, 1)
        self.movie_bias = keras.layers.Embedding(MOVIES, 1)

    def call(self, inputs):
        user, movie = self.user(inputs[:, 0]), self.movie(inputs[:, 1])
        if self.per_row:  # the fix: one dot product per row
            dot = ops.sum(user * movie, axis=-1, keepdims=True)
        else:
            dot = ops.tensordot(user, movie, 2)
        return ops.sigmoid(dot + self.user_bias(inputs[:, 0]) + self.movie_bias(inputs[:, 1]))


def _model(per_row=False):
    keras.utils.set_random_seed(0)
    model = Recommender(per_row=per_row, name="per_row" if per_row else "coupled")
    model.compile(optimizer="adam", loss="binary_crossentropy")
    return model


def _data(n):
    rng = np.random.default_rng(0)
    x = np.stack([rng.integers(0, USERS, n), rng.integers(0, MOVIES, n)], axis=1).astype("int32")
    return x, rng.random((n, 1), dtype=np.float32)


def _fit(model, caplog, mode="accumulate"):
    x, y = _data(64)
    with caplog.at_level(logging.WARNING, logger="keras_memfit"):
        model.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[MemFit(mode=mode)])
    return [r for r in caplog.records if COUPLING in r.getMessage()]


def test_plain_keras_gives_other_results_at_another_batch_size():
    x, _ = _data(64)
    model = _model()
    model(x[:2])
    assert not np.allclose(model.predict(x, batch_size=32, verbose=0),
                           model.predict(x, batch_size=16, verbose=0), rtol=1e-3)


@pytest.mark.parametrize("mode", ["accumulate", "shrink"])
def test_one_warning_names_a_coupled_model_when_a_batch_is_first_split(inject_oom, caplog,
                                                                       mode):
    inject_oom(16, phases=("train",))
    warnings = _fit(_model(), caplog, mode)
    assert inject_oom.ooms(), "nothing was split: the test proves nothing"
    assert len(warnings) == 1, [r.getMessage() for r in warnings]  # once, not per batch
    assert warnings[0].levelno == logging.WARNING
    assert "'coupled'" in warnings[0].getMessage()


def test_a_split_validation_batch_warns_too(inject_oom, caplog):
    inject_oom(16, phases=("evaluate",))
    x, y = _data(64)
    with caplog.at_level(logging.WARNING, logger="keras_memfit"):
        _model().fit(x, y, batch_size=64, epochs=1, verbose=0, validation_data=(x, y),
                     validation_batch_size=32, callbacks=[MemFit()])
    assert inject_oom.ooms()
    assert len([r for r in caplog.records if COUPLING in r.getMessage()]) == 1


def test_no_warning_for_rows_that_are_independent(inject_oom, caplog):
    inject_oom(16, phases=("train",))
    assert _fit(_model(per_row=True), caplog) == []
    assert inject_oom.ooms()


def test_no_warning_when_nothing_is_split(inject_oom, caplog):
    inject_oom(None)
    assert _fit(_model(), caplog) == []


@pytest.mark.parametrize("batch_size", [None, 256])
def test_with_no_pressure_keras_batches_and_keras_values(batch_size):
    x, y = _data(1000)  # 256 rows: three batches and a remainder of 232
    model = _model()
    expected = model.predict(x, batch_size=batch_size, verbose=0)
    result = safe_predict(model, x, batch_size=batch_size, verbose=0)
    if BACKEND == "tensorflow":  # one trace for every batch size (docs/inference.md)
        np.testing.assert_allclose(result, expected, rtol=1e-6, atol=0)
    else:
        np.testing.assert_array_equal(result, expected)
    assert safe_evaluate(model, x, y, batch_size=batch_size, verbose=0) == model.evaluate(
        x, y, batch_size=batch_size, verbose=0)
