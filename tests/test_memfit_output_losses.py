"""Per-output losses in History under MemFit equal Keras's, short last batches included.

The model is of the shape of the Keras functional API guide's
multi-input, multi-output example: two token inputs through Embeddings,
a feature input, two named outputs with their own losses and loss weights,
so Keras logs `priority_loss` and `department_loss` beside `loss`. Keras
weights those per-output trackers differently per backend (TensorFlow's
traced step counts each batch once, JAX and torch weight it by rows); the
reference is always plain Keras on the same data from the same initial
weights, so the test holds on each. 40 rows at batch 16 make a short last
batch (16, 16, 8); validation data of 20 rows another (16, 4).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

from keras_memfit import MemFit

RTOL = 1e-5
ATOL = 1e-6
SEED = 5
TOKENS, WORDS, TAGS, DEPARTMENTS = 6, 50, 4, 3


def _model():
    keras.utils.set_random_seed(SEED)
    title = keras.Input((TOKENS,), name="title")
    body = keras.Input((TOKENS,), name="body")
    tags = keras.Input((TAGS,), name="tags")
    title_features = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(WORDS, 8)(title))
    body_features = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(WORDS, 8)(body))
    x = keras.layers.concatenate([title_features, body_features, tags])
    priority = keras.layers.Dense(1, name="priority")(x)
    department = keras.layers.Dense(DEPARTMENTS, name="department")(x)
    model = keras.Model({"title": title, "body": body, "tags": tags},
                        {"priority": priority, "department": department})
    model.compile(
        optimizer=keras.optimizers.RMSprop(0.01),
        loss={"priority": keras.losses.BinaryCrossentropy(from_logits=True),
              "department": keras.losses.CategoricalCrossentropy(from_logits=True)},
        loss_weights={"priority": 1.0, "department": 0.2},
    )
    return model


def _data(n, seed):
    rng = np.random.default_rng(seed)
    x = {"title": rng.integers(WORDS, size=(n, TOKENS)),
         "body": rng.integers(WORDS, size=(n, TOKENS)),
         "tags": rng.integers(2, size=(n, TAGS)).astype("float32")}
    y = {"priority": rng.uniform(size=(n, 1)).astype("float32"),
         "department": keras.utils.to_categorical(rng.integers(DEPARTMENTS, size=n),
                                                  DEPARTMENTS)}
    return x, y


def _fit(callbacks):
    model = _model()
    history = model.fit(*_data(40, 0), validation_data=_data(20, 1), batch_size=16, epochs=2,
                        shuffle=False, verbose=0, callbacks=callbacks)
    return model, history


def _assert_same_history(history, ref_history):
    for key in ("priority_loss", "department_loss", "loss",
                "val_priority_loss", "val_department_loss", "val_loss"):
        assert key in ref_history.history, key
        np.testing.assert_allclose(history.history[key], ref_history.history[key],
                                   rtol=RTOL, atol=ATOL, err_msg=key)


def test_per_output_losses_with_a_short_last_batch_are_kerass():
    reference, ref_history = _fit([])
    model, history = _fit([MemFit()])
    _assert_same_history(history, ref_history)
    for a, e in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, e, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("mode", ["accumulate", "shrink"])
def test_per_output_losses_of_split_batches_are_kerass(inject_oom, mode):
    # Every batch of 16 (training and validation) runs out of memory: each is
    # run in pieces of 8 or fewer, and still counts as the one batch it is.
    # "shrink" trains each piece as its own step: Keras's at batch_size=8
    # (its validation batches still of 16).
    reference = _model()
    ref_history = reference.fit(*_data(40, 0), validation_data=_data(20, 1), epochs=2,
                                batch_size=16 if mode == "accumulate" else 8,
                                validation_batch_size=16, shuffle=False, verbose=0)
    inject_oom(8)
    model, history = _fit([MemFit(mode=mode)])
    assert inject_oom.ooms("train") and inject_oom.ooms("evaluate")
    assert max(inject_oom.ok_rows("evaluate")) < 16
    _assert_same_history(history, ref_history)
    for a, e in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, e, rtol=RTOL, atol=ATOL)
