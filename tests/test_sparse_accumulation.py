"""What MemFit holds for a sparse gradient (an Embedding's) across micro-batches.

On TensorFlow an `Embedding`'s gradient is a `tf.IndexedSlices` with one row
per lookup, and Keras hands the optimizer those rows. SGD adds them up, so
MemFit sums them densely (at most the weight's size, whatever the batch);
Adam and RMSprop square each row, so MemFit keeps every row, as many as
Keras's own step holds (`accumulation.sums_sparse_exactly`). These tests
check, against plain Keras:

- without a cap (injected OOMs split every batch): one accumulated step
  gives the weights and slots of Keras's unsplit step, SGD within float
  rounding (the rows are added in another order), Adam and RMSprop too (the
  same rows, each micro-batch's scaled by its share);
- under a real cap: plain Keras runs out of memory at the large batch and
  trains at a smaller one, and MemFit trains at the large batch (SGD: the
  update holds a dense sum the weight's size, not the batch's rows), equal to
  plain Keras at that batch run uncapped in a separate process;
- an OOM in the update of kept rows says what it held and that it grows with
  the batch.

Run directly, this file is the uncapped reference:
`python tests/test_sparse_accumulation.py OUT.npz`.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB, LENGTH, DIM = 100, 8, 4
# Pieces of at most 7 rows (56 lookups): SGD keeps the first piece's rows, then sums.
N, BATCH, THRESHOLD = 48, 24, 7
TOL = dict(rtol=1e-5, atol=1e-6)
SLOT_RTOL, SLOT_ATOL_SHARE = 1e-4, 1e-6  # absolute: a share of the slot's largest entry
# The capped scenario: Embedding(1000, 64) on 100 tokens a row, SGD.
CAP_MB = 13
BIG = dict(vocab=1000, length=100, dim=64, rows=1024, batch=512, small=128)

pytestmark = pytest.mark.tensorflow(reason="sparse gradients (tf.IndexedSlices) are TensorFlow's")


def _optimizer(name):
    import keras

    return {
        "sgd": lambda: keras.optimizers.SGD(learning_rate=0.1, momentum=0.9),
        "adam": lambda: keras.optimizers.Adam(learning_rate=1e-2),
        "rmsprop": lambda: keras.optimizers.RMSprop(learning_rate=1e-2),
    }[name]()


def _model(optimizer, vocab=VOCAB, length=LENGTH, dim=DIM):
    import keras

    keras.utils.set_random_seed(3)
    ids = keras.Input((length,), dtype="int32")
    h = keras.layers.Embedding(vocab, dim, name="emb")(ids)
    h = keras.layers.GlobalAveragePooling1D()(h)
    model = keras.Model(ids, keras.layers.Dense(1)(h))
    model.compile(optimizer=_optimizer(optimizer), loss="mse")
    return model


def _data(n=N, vocab=VOCAB, length=LENGTH):
    rng = np.random.default_rng(0)
    x = rng.integers(0, vocab, size=(n, length)).astype("int32")
    return x, rng.normal(size=(n, 1)).astype("float32")


def _assert_same_state(reference, model):
    for ref, got in zip(reference.weights, model.get_weights()):
        np.testing.assert_allclose(got, np.array(ref), err_msg=ref.path, **TOL)
    assert int(model.optimizer.iterations) == int(reference.optimizer.iterations) > 0
    for ref, var in zip(reference.optimizer.variables, model.optimizer.variables):
        want = np.array(ref)
        np.testing.assert_allclose(
            np.array(var), want, err_msg=ref.path, rtol=SLOT_RTOL,
            atol=SLOT_ATOL_SHARE * float(np.max(np.abs(want), initial=0.0)),
        )


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "rmsprop"])
def test_accumulated_sparse_gradients_give_kerass_unsplit_step(inject_oom, optimizer):
    from keras_memfit import MemFit

    x, y = _data()
    reference = _model(optimizer)
    reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    model = _model(optimizer)
    inject_oom(THRESHOLD)
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[MemFit()])
    inject_oom(None)
    assert inject_oom.ooms("train") and max(inject_oom.ok_rows("train")) <= THRESHOLD
    _assert_same_state(reference, model)


def test_an_oom_in_the_update_of_kept_rows_says_what_it_held(inject_oom, monkeypatch):
    from keras_memfit import MemFit, OutOfMemoryError
    from support import oom_error

    x, y = _data()
    model = _model("rmsprop")

    def out_of_memory(grads_and_vars):
        raise oom_error()

    monkeypatch.setattr(model.optimizer, "apply_gradients", out_of_memory)
    inject_oom(THRESHOLD)
    with pytest.raises(OutOfMemoryError) as caught:
        model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, verbose=0, callbacks=[MemFit()])
    inject_oom(None)
    message = str(caught.value)
    rows = BATCH * LENGTH  # one per lookup, as Keras's unsplit step's gradient
    assert f"held {rows} rows of 'emb/embeddings' ({rows * DIM * 4 / 1024:.1f} KiB)" in message
    assert f"in the optimizer update of a batch of {BATCH} rows" in message
    assert "RMSprop updates them row by row" in message
    assert "grow with the batch size" in message
    assert "does not depend on the batch size" not in message
    assert caught.value.cause == "update" and caught.value.rows == BATCH


def _fit_big(batch):
    """Plain Keras on the capped scenario at `batch`; the model."""
    x, y = _data(BIG["rows"], BIG["vocab"], BIG["length"])
    model = _model("sgd", BIG["vocab"], BIG["length"], BIG["dim"])
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    return model


def _reference_env():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TF_CPU_") and k != "KERAS_MEMFIT_TEST_CAPPED"}
    env.update(TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    return env


@pytest.mark.memory_cap(CAP_MB)
def test_memfit_trains_an_embedding_at_a_batch_plain_keras_cannot(tmp_path):
    import tensorflow as tf

    from keras_memfit import MemFit

    out = str(tmp_path / "reference.npz")
    reference = subprocess.Popen(  # uncapped, while this one waits out its OOMs
        [sys.executable, os.path.abspath(__file__), out], cwd=ROOT, env=_reference_env(),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        with pytest.raises(tf.errors.ResourceExhaustedError):
            _fit_big(BIG["batch"])
        _fit_big(BIG["small"])  # plain Keras trains at the smaller batch
        x, y = _data(BIG["rows"], BIG["vocab"], BIG["length"])
        model = _model("sgd", BIG["vocab"], BIG["length"], BIG["dim"])
        history = model.fit(x, y, batch_size=BIG["batch"], epochs=1, shuffle=False, verbose=0,
                            callbacks=[MemFit()])
        assert max(history.history["memfit_split"]) > 1
        output, _ = reference.communicate(timeout=300)
    finally:
        if reference.poll() is None:
            reference.kill()
            reference.communicate()
    assert reference.returncode == 0, output[-4000:]
    with np.load(out) as want:
        for i, got in enumerate(model.get_weights()):
            np.testing.assert_allclose(got, want[f"w{i}"], **TOL)


if __name__ == "__main__":
    weights = _fit_big(BIG["batch"]).get_weights()
    np.savez(sys.argv[1], **{f"w{i}": w for i, w in enumerate(weights)})
