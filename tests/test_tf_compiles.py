"""TensorFlow with `jit_compile=True`: safe_predict compiles few shapes under a real OOM.

With `jit_compile=True` (which Keras turns on by itself on a GPU) XLA
compiles every new piece size. The child process runs under TensorFlow's
capped CPU allocator (real `ResourceExhaustedError`s, `app.env.capped_cpu_env`)
with XLA dumping every module it compiles (`tests/compile_count.py`), and
counts the oracle's compilations, plain `model.predict` at a batch that fits,
with the same counter: safe_predict's first call compiles at most one more,
its second none. The same for `fit` with MemFit against plain `fit` at a batch
that fits: at most two more over a first and a second fit that adapt (the
micro-batch step at the size that ran out of memory and at the one that fits,
and the update step; the second fit compiles nothing new, although the first
fit's gradient sums were freed when it ended). The adapted fit's weights
equal one SGD step on the whole batch's gradient, summed here in chunks with
a plain `tf.GradientTape`: an XLA OOM must leave the accumulator's sums and
the model's small state intact (TensorFlow donates the buffers of the
variables an XLA call updates, and frees them when the call fails).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.jax_support import ROOT

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None,
    reason=f"TensorFlow is not installed for {sys.executable} (the JAX CI leg)",
)

CAP_MB = 100
ROWS, ORACLE_BATCH = 8000, 1000  # 8000 rows need 125 MiB of activations; 1000 fit


def _model():
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(4096, activation="relu"),
        keras.layers.Dense(3, activation="softmax"),
    ])
    model.compile("sgd", "sparse_categorical_crossentropy", jit_compile=True)
    return model


def child_predict():
    import keras_memfit
    from tests.compile_count import TfCompiles

    x = np.random.default_rng(0).random((ROWS, 8), dtype=np.float32)
    model = _model()
    assert model.jit_compile
    with TfCompiles() as oracle:
        expected = model.predict(x, batch_size=ORACLE_BATCH, verbose=0)
    try:
        model.predict(x, batch_size=ROWS, verbose=0)
        raise AssertionError("plain predict at the full batch fitted: the cap is too high")
    except Exception as err:  # noqa: BLE001
        assert keras_memfit.is_oom_error(err), str(err)[:300]
    model = _model()
    for call, most in ((1, oracle.count + 1), (2, 0)):
        with TfCompiles() as compiles:
            result = keras_memfit.safe_predict(model, x, batch_size=ROWS, verbose=0)
        np.testing.assert_allclose(result, expected, rtol=1e-5, atol=1e-6)
        print(f"call {call}: {compiles.count} compilations (oracle {oracle.count})")
        assert compiles.count <= most, (call, compiles.count, oracle.count)


def _one_sgd_step_reference(x, y, batch):
    """One SGD step on all of `x`, its gradient summed over chunks of `batch`.

    Returns:
        The weights after the step, and the loss on all of `x` before it.
    """
    import keras
    import tensorflow as tf

    model = _model()
    loss_fn = keras.losses.SparseCategoricalCrossentropy()
    weights = model.trainable_weights
    total, mean = [tf.zeros_like(w) for w in weights], 0.0
    for start in range(0, len(x), batch):
        xs, ys = x[start:start + batch], y[start:start + batch]
        with tf.GradientTape() as tape:
            loss = loss_fn(ys, model(xs, training=True)) * (len(xs) / len(x))
        total = [t + g for t, g in zip(total, tape.gradient(loss, weights))]
        mean += float(loss)
    rate = float(model.optimizer.learning_rate)
    return [w.numpy() - rate * t.numpy() for w, t in zip(weights, total)], mean


def child_fit():
    import keras_memfit
    from tests.compile_count import TfCompiles

    rng = np.random.default_rng(0)
    x = rng.random((ROWS, 8), dtype=np.float32)
    y = rng.integers(0, 3, ROWS)
    fit = dict(epochs=1, shuffle=False, verbose=0)
    model = _model()
    with TfCompiles() as oracle:
        for _ in range(2):
            model.fit(x, y, batch_size=ORACLE_BATCH, **fit)
    model = _model()
    extra = 0
    for call in (1, 2):
        memfit = keras_memfit.MemFit()
        with TfCompiles() as compiles:
            model.fit(x, y, batch_size=ROWS, callbacks=[memfit], **fit)
        assert memfit.events, "nothing adapted: the cap is too high"
        if call == 1:
            trained = [w.numpy() for w in model.trainable_weights]
        extra += compiles.count - (oracle.count if call == 1 else 0)
        print(f"fit {call}: {compiles.count} compilations (oracle {oracle.count} over two fits)")
    del model
    weights, _ = _one_sgd_step_reference(x, y, ORACLE_BATCH // 2)
    for got, want in zip(trained, weights):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    assert extra <= 2, extra


def child_accumulate_after_xla_oom():
    import keras_memfit
    from keras_memfit import backend

    rng = np.random.default_rng(0)
    x = rng.random((ROWS, 8), dtype=np.float32)
    y = rng.integers(0, 3, ROWS)
    model = _model()
    accumulator = backend.get().make_accumulator(model)
    accumulator.reset()
    try:
        accumulator.add((x, y), 1.0, 1.0)  # the whole batch: XLA runs out of memory
        raise AssertionError("the whole batch fitted: the cap is too high")
    except Exception as err:  # noqa: BLE001
        assert keras_memfit.is_oom_error(err), str(err)[:300]
    accumulator.reset()
    for start in range(0, ROWS, ORACLE_BATCH):
        accumulator.add((x[start:start + ORACLE_BATCH], y[start:start + ORACLE_BATCH]),
                        ORACLE_BATCH / ROWS, 1.0)
    accumulator.apply()
    trained = [w.numpy() for w in model.trainable_weights]
    tracked = float(model.metrics[0].result())  # the loss tracker, after the failed micro-batch
    del accumulator, model
    weights, loss = _one_sgd_step_reference(x, y, ORACLE_BATCH // 2)
    for got, want in zip(trained, weights):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(tracked, loss, rtol=1e-5)
    print("accumulated after an XLA OOM: as one step on the whole batch")


def _run_child(tmp_path, name):
    from keras_memfit.app.env import capped_cpu_env
    from tests.compile_count import tf_dump_env

    env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2",
               **capped_cpu_env(CAP_MB), **tf_dump_env(str(tmp_path / "xla")))
    target = f"{os.path.abspath(__file__)}:{name}"
    proc = subprocess.run([sys.executable, "-m", "tests.jax_support", target, "0"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    return output


def test_jit_compiled_safe_predict_compiles_at_most_one_shape_more_than_keras(tmp_path):
    output = _run_child(tmp_path, "child_predict")
    assert "call 2: 0 compilations" in output, output[-3000:]


def test_jit_compiled_fit_with_memfit_compiles_at_most_two_more_than_keras(tmp_path):
    output = _run_child(tmp_path, "child_fit")
    assert "fit 2: 0 compilations" in output, output[-3000:]


def child_train_step_after_xla_oom():
    import tensorflow as tf

    import keras_memfit
    from keras_memfit import backend

    rng = np.random.default_rng(0)
    x = rng.random((ROWS, 8), dtype=np.float32)
    y = rng.integers(0, 3, ROWS)
    model = _model()
    step = backend.get().make_train_step(model)
    try:
        step((tf.constant(x), tf.constant(y)))  # the whole batch: XLA runs out of memory
        raise AssertionError("the whole batch fitted: the cap is too high")
    except Exception as err:  # noqa: BLE001
        assert keras_memfit.is_oom_error(err), str(err)[:300]
    assert step.last_outcome is not None and step.last_outcome.name == "UNTOUCHED", step.last_outcome
    part = slice(0, ORACLE_BATCH)
    step((tf.constant(x[part]), tf.constant(y[part])))
    trained = [w.numpy() for w in model.trainable_weights]
    del step, model
    weights, _ = _one_sgd_step_reference(x[part], y[part], ORACLE_BATCH // 2)
    for got, want in zip(trained, weights):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    print("a step after an XLA OOM: as on an untouched model")


def test_an_xla_oom_of_the_train_step_leaves_the_weights_intact(tmp_path):
    output = _run_child(tmp_path, "child_train_step_after_xla_oom")
    assert "as on an untouched model" in output, output[-3000:]


def test_an_xla_oom_of_a_micro_batch_leaves_the_sums_and_small_state_intact(tmp_path):
    output = _run_child(tmp_path, "child_accumulate_after_xla_oom")
    assert "as one step on the whole batch" in output, output[-3000:]
