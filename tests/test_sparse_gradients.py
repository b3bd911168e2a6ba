"""MemFit's accumulation of sparse gradients (an Embedding's) against plain Keras.

Issue 21, item 1: on TensorFlow an `Embedding`'s gradient is a
`tf.IndexedSlices` with one row per token occurrence, and Keras hands Adam that
sparse gradient itself; Adam squares it row by row (`ops.square` keeps the
slices), so a token met twice adds `g1**2 + g2**2` to its velocity, not
`(g1 + g2)**2`. An accumulator that sums the micro-batches' gradients into a
dense tensor gives Adam a different velocity (2x for a token met twice with
equal gradients). MemFit must give the optimizer the gradient Keras's unsplit
step gives it, whatever its type.

The reference is independent of keras_memfit: the same model (same seed) fit
by plain Keras at the full batch, which fits; the MemFit run gets injected OOMs
(`inject_oom`, conftest.py) above a few rows, so every batch is accumulated
from pieces. Token ids are drawn from a small vocabulary, so ids repeat inside
each piece and across pieces. The optimizer state is compared with a relative
tolerance and an absolute one scaled to each slot's largest entry: Adam's
velocities are ~1e-9, below the absolute tolerance of the weights. Runs on
every backend (on JAX the gradient is dense and accumulation was exact
already); the check of the gradient types the optimizer is handed is
TensorFlow's.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

from keras_memfit import MemFit

VOCAB, LENGTH, DIM = 12, 6, 4
N, BATCH, THRESHOLD = 48, 24, 7  # pieces of at most 7 rows: 4 per batch
WEIGHT_TOL = dict(rtol=1e-5, atol=1e-6)
SLOT_RTOL, SLOT_ATOL_SHARE = 1e-4, 1e-6  # absolute: a share of the slot's largest entry


def _data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, VOCAB, size=(N, LENGTH)).astype("int32")
    y = rng.normal(size=(N, 2)).astype("float32")
    w = rng.uniform(0.2, 2.0, size=N).astype("float32")
    return x, y, w


OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(learning_rate=1e-3),
    "sgd": lambda: keras.optimizers.SGD(learning_rate=0.1),
    "sgd-momentum": lambda: keras.optimizers.SGD(learning_rate=0.1, momentum=0.9),
    "adamw-clipnorm": lambda: keras.optimizers.AdamW(learning_rate=1e-3, clipnorm=0.05),
}


def _embedding_model(optimizer, seed=3, **compile_kwargs):
    keras.utils.set_random_seed(seed)
    ids = keras.Input((LENGTH,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, DIM, name="emb")(ids)
    h = keras.layers.GlobalAveragePooling1D()(keras.layers.Dense(5, activation="tanh")(h))
    model = keras.Model(ids, keras.layers.Dense(2)(h))
    model.compile(optimizer=OPTIMIZERS[optimizer](), loss="mse", **compile_kwargs)
    return model


def _fit_both(inject_oom, optimizer, epochs, compile_kwargs=None, **fit_kwargs):
    x, y, _ = _data()
    kwargs = dict(x=x, y=y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)
    kwargs.update(fit_kwargs)
    reference = _embedding_model(optimizer, **(compile_kwargs or {}))
    inject_oom(None)
    reference.fit(**kwargs)
    assert inject_oom.calls == []
    model = _embedding_model(optimizer, **(compile_kwargs or {}))
    inject_oom(THRESHOLD)
    model.fit(callbacks=[MemFit()], **kwargs)
    inject_oom(None)
    assert inject_oom.ooms("train"), "no batch was split"
    assert max(inject_oom.ok_rows("train")) <= THRESHOLD
    return reference, model


def _assert_same_state(reference, model):
    names = [w.path for w in reference.weights]
    for name, got, want in zip(names, model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, err_msg=name, **WEIGHT_TOL)
    assert int(model.optimizer.iterations) == int(reference.optimizer.iterations) > 0
    for ref_var, var in zip(reference.optimizer.variables, model.optimizer.variables):
        want = np.array(ref_var)
        np.testing.assert_allclose(
            np.array(var), want, err_msg=ref_var.path,
            rtol=SLOT_RTOL, atol=SLOT_ATOL_SHARE * float(np.max(np.abs(want), initial=0.0)),
        )


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_one_accumulated_step_equals_kerass_unsplit_step(inject_oom, optimizer):
    x, y, _ = _data()
    reference, model = _fit_both(inject_oom, optimizer, epochs=1, x=x[:BATCH], y=y[:BATCH])
    assert int(model.optimizer.iterations) == 1
    _assert_same_state(reference, model)


@pytest.mark.parametrize("how", ["jit_compile", "run_eagerly"])
def test_one_accumulated_adam_step_equals_kerass_compiled_by_xla_or_eager(inject_oom, how):
    x, y, _ = _data()
    reference, model = _fit_both(inject_oom, "adam", epochs=1, compile_kwargs={how: True},
                                 x=x[:BATCH], y=y[:BATCH])
    _assert_same_state(reference, model)


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_accumulated_epochs_equal_kerass_unsplit_fit(inject_oom, optimizer):
    reference, model = _fit_both(inject_oom, optimizer, epochs=2)
    _assert_same_state(reference, model)


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_accumulated_epochs_with_sample_weights_equal_kerass(inject_oom, optimizer):
    x, y, w = _data()
    reference, model = _fit_both(inject_oom, optimizer, epochs=2, sample_weight=w)
    _assert_same_state(reference, model)


def test_a_short_last_batch_equals_kerass(inject_oom):
    # 48 rows in batches of 20: 20, 20 and a last batch of 8 (pieces 7 + 1).
    reference, model = _fit_both(inject_oom, "adam", epochs=2, batch_size=20)
    _assert_same_state(reference, model)


@pytest.mark.tensorflow(reason="the types of TensorFlow's gradients (IndexedSlices)")
def test_the_optimizer_gets_the_gradient_type_keras_gives_it(inject_oom, monkeypatch):
    """What each `update_step` is handed, recorded at trace time, as Keras's own step."""
    seen = {"keras": [], "memfit": []}
    target = []
    update_step = keras.optimizers.Adam.update_step

    def recording(self, gradient, variable, learning_rate):
        if target:
            seen[target[0]].append((variable.name, type(gradient).__name__))
        return update_step(self, gradient, variable, learning_rate)

    monkeypatch.setattr(keras.optimizers.Adam, "update_step", recording)
    x, y, _ = _data()
    reference = _embedding_model("adam")
    target[:] = ["keras"]
    reference.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    model = _embedding_model("adam")
    target[:] = ["memfit"]
    inject_oom(THRESHOLD)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[MemFit()])
    assert inject_oom.ooms("train")

    def kinds(fitted, who):  # per trainable weight, in order: the kinds it was handed
        recorded = {}
        for name, kind in seen[who]:
            recorded.setdefault(name, set()).add(kind)
        return [recorded.get(w.value.name) for w in fitted.trainable_weights]

    assert kinds(model, "memfit") == kinds(reference, "keras")
    assert all(kinds(reference, "keras"))
    assert kinds(reference, "keras")[0] == {"IndexedSlices"}  # the embedding's
