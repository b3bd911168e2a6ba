"""MemFit under `tf.distribute.MirroredStrategy` as on one device: what a split must keep.

Two logical CPUs (`two_devices`: one child process for the module). Batches
are split by `inject_oom` (conftest.py: a distributed batch's rows are its
largest replica's). The reference is plain Keras under the same strategy at
the unsplit batch, from the same initial weights:

- per-output losses of a multi-output model (short last batches split
  unevenly across the replicas, validation too): History as Keras's, with
  no pressure and with every batch split (each replica's batch counted once,
  as Keras's step counts it);
- a model that couples the rows of a batch: one warning at the first split;
- an Embedding's sparse gradient: the weights and optimizer slots of Keras's
  unsplit step, for Adam and RMSprop (which update each row: Keras's
  all-reduce hands them every replica's rows) and SGD.
"""

from __future__ import annotations

import functools
import logging

import keras
import numpy as np
import pytest
from keras import ops
from support import requires_keras

from keras_memfit import MemFit

pytestmark = [
    pytest.mark.two_devices,
    pytest.mark.skipif(keras.backend.backend() != "tensorflow",
                       reason="tf.distribute needs Keras's TensorFlow backend"),
]
TOL = dict(rtol=1e-5, atol=1e-6)
SLOT_RTOL, SLOT_ATOL_SHARE = 1e-4, 1e-6  # absolute: a share of the slot's largest entry


@functools.lru_cache(maxsize=None)
def _strategy():
    """One strategy for the module (each new one starts TensorFlow's collective keys again)."""
    import tensorflow as tf

    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    assert len(devices) == 2, devices  # the two_devices child
    return tf.distribute.MirroredStrategy(devices)


def _assert_same_state(model, reference):
    for w, r in zip(model.weights, reference.weights):
        np.testing.assert_allclose(np.array(w), np.array(r), err_msg=w.path, **TOL)
    iterations = [int(np.array(m.optimizer.iterations)) for m in (model, reference)]
    assert iterations[0] == iterations[1] > 0
    for v, r in zip(model.optimizer.variables, reference.optimizer.variables):
        want = np.array(r)
        np.testing.assert_allclose(
            np.array(v), want, err_msg=r.path, rtol=SLOT_RTOL,
            atol=SLOT_ATOL_SHARE * float(np.max(np.abs(want), initial=0.0)),
        )


# ------------------------------------------------------- per-output losses
WORDS, TOKENS, TAGS = 50, 6, 4


def _two_outputs(strategy):
    """Keras's multi-input, multi-output guide model, small (two losses, loss weights)."""
    keras.utils.set_random_seed(5)
    with strategy.scope():
        title, body = keras.Input((TOKENS,), name="title"), keras.Input((TOKENS,), name="body")
        tags = keras.Input((TAGS,), name="tags")
        pooled = [keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(WORDS, 8)(t))
                  for t in (title, body)]
        h = keras.layers.concatenate(pooled + [tags])
        model = keras.Model(
            {"title": title, "body": body, "tags": tags},
            {"priority": keras.layers.Dense(1, name="priority")(h),
             "department": keras.layers.Dense(3, name="department")(h)},
        )
        model.compile(
            optimizer=keras.optimizers.RMSprop(0.01),
            loss={"priority": keras.losses.BinaryCrossentropy(from_logits=True),
                  "department": keras.losses.CategoricalCrossentropy(from_logits=True)},
            loss_weights={"priority": 1.0, "department": 0.2},
        )
    return model


def _two_output_data(n, seed):
    rng = np.random.default_rng(seed)
    x = {"title": rng.integers(WORDS, size=(n, TOKENS)),
         "body": rng.integers(WORDS, size=(n, TOKENS)),
         "tags": rng.integers(2, size=(n, TAGS)).astype("float32")}
    y = {"priority": rng.uniform(size=(n, 1)).astype("float32"),
         "department": keras.utils.to_categorical(rng.integers(3, size=n), 3)}
    return x, y


@requires_keras((3, 13), "Keras's own metrics under MirroredStrategy depend on the batch size")
def test_per_output_losses_count_each_replicas_batch_once(inject_oom):
    """45 rows at 16: batches of 8 + 8 rows per replica, the last 7 + 6; validation
    21 rows: 8 + 8, then 3 + 2. With no pressure, then split into pieces of at most
    4 rows per replica."""
    strategy = _strategy()
    fit = dict(validation_data=_two_output_data(21, 1), batch_size=16, epochs=1,
               shuffle=False, verbose=0)
    reference = _two_outputs(strategy)
    ref_history = reference.fit(*_two_output_data(45, 0), **fit)
    assert {"priority_loss", "val_department_loss"} <= set(ref_history.history)
    for threshold in (None, 4):
        model = _two_outputs(strategy)
        inject_oom(threshold)
        history = model.fit(*_two_output_data(45, 0), callbacks=[MemFit()], **fit)
        inject_oom(None)
        split = threshold is not None
        assert bool(inject_oom.ooms("train")) == bool(inject_oom.ooms("evaluate")) == split
        for key, values in ref_history.history.items():
            np.testing.assert_allclose(history.history[key], values, err_msg=key, **TOL)
        _assert_same_state(model, reference)


# ------------------------------------------------------------ coupled rows
COUPLING = "couples the rows of a batch"


class _Scores(keras.Model):
    """keras-io's RecommenderNet, reduced: `tensordot(a, b, 2)` sums over the batch too."""

    def __init__(self, per_row, **kwargs):
        super().__init__(**kwargs)
        self.per_row = per_row
        self.users = keras.layers.Embedding(20, 4)
        self.items = keras.layers.Embedding(20, 4)

    def call(self, ids):
        users, items = self.users(ids[:, 0]), self.items(ids[:, 1])
        if self.per_row:
            return ops.sum(users * items, axis=-1, keepdims=True)
        return ops.tensordot(users, items, 2) + 0.0 * users[:, :1]


@pytest.mark.parametrize("per_row", [False, True], ids=["coupled", "per-row"])
def test_a_model_coupling_its_rows_is_named_at_the_first_split(inject_oom, caplog, per_row):
    """As on one device (tests/test_batch_coupling.py): one WARNING, none for per-row scores."""
    strategy = _strategy()
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = _Scores(per_row, name="per_row" if per_row else "coupled")
        model.compile(optimizer="adam", loss="mse")
    rng = np.random.default_rng(0)
    x = rng.integers(0, 20, size=(64, 2)).astype("int32")
    inject_oom(8, phases=("train",))
    with caplog.at_level(logging.WARNING, logger="keras_memfit"):
        model.fit(x, rng.random((64, 1)), batch_size=32, epochs=2, verbose=0,
                  callbacks=[MemFit()])
    assert inject_oom.ooms("train"), "nothing was split: the test proves nothing"
    warned = [r.getMessage() for r in caplog.records if COUPLING in r.getMessage()]
    assert len(warned) == (0 if per_row else 1), warned
    assert per_row or "'coupled'" in warned[0]


# -------------------------------------------------------- sparse gradients
VOCAB, LENGTH = 12, 6
OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(learning_rate=1e-2),
    "sgd-momentum": lambda: keras.optimizers.SGD(learning_rate=0.1, momentum=0.9),
}


def _embedding_model(strategy, optimizer):
    keras.utils.set_random_seed(3)
    with strategy.scope():
        ids = keras.Input((LENGTH,), dtype="int32")
        h = keras.layers.Embedding(VOCAB, 4, name="emb")(ids)
        h = keras.layers.GlobalAveragePooling1D()(keras.layers.Dense(5, activation="tanh")(h))
        model = keras.Model(ids, keras.layers.Dense(2)(h))
        model.compile(optimizer=OPTIMIZERS[optimizer](), loss="mse")
    return model


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_sparse_gradients_give_kerass_unsplit_update(inject_oom, optimizer):
    """A small vocabulary: tokens repeat inside each piece, across pieces and replicas.

    45 rows at 24: 12 + 12 rows per replica, then 11 + 10; pieces of at most
    3 rows per replica. (RMSprop: the per-output test's model.)
    """
    strategy = _strategy()
    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCAB, size=(45, LENGTH)).astype("int32")
    y = rng.normal(size=(45, 2)).astype("float32")
    fit = dict(batch_size=24, epochs=1, shuffle=False, verbose=0)
    reference = _embedding_model(strategy, optimizer)
    reference.fit(x, y, **fit)
    model = _embedding_model(strategy, optimizer)
    inject_oom(3)
    model.fit(x, y, callbacks=[MemFit()], **fit)
    inject_oom(None)
    assert inject_oom.ooms("train") and max(inject_oom.ok_rows("train")) <= 3
    _assert_same_state(model, reference)


def test_an_oom_in_the_update_of_kept_rows_says_what_it_held(inject_oom, monkeypatch):
    """As on one device (tests/test_sparse_accumulation.py): every replica's rows, named."""
    from support import oom_error

    from keras_memfit import OutOfMemoryError

    model = _embedding_model(_strategy(), "adam")
    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCAB, size=(24, LENGTH)).astype("int32")

    def out_of_memory(grads_and_vars):
        raise oom_error()

    monkeypatch.setattr(model.optimizer, "apply_gradients", out_of_memory)
    inject_oom(3)
    with pytest.raises(OutOfMemoryError) as caught:
        model.fit(x, rng.normal(size=(24, 2)), batch_size=24, verbose=0, callbacks=[MemFit()])
    inject_oom(None)
    rows = 24 * LENGTH  # one per lookup, on both replicas together
    assert f"held {rows} rows of 'emb/embeddings' ({rows * 4 * 4 / 1024:.1f} KiB)" in str(
        caught.value)
    assert "Adam updates them row by row" in str(caught.value)
    assert caught.value.cause == "update" and caught.value.rows == 24
