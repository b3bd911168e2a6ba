"""TensorFlow under XLA (`jit_compile=True`): MemFit's train step as two calls.

Keras turns `jit_compile` on by itself on a GPU. TensorFlow's XLA launch
donates the buffers of the variables a compiled call updates and frees them
if the call fails, so a fused step that survives an OOM must hold what it
updates, and XLA then writes the updates into new buffers. MemFit's default
step under XLA is a gradient call that updates only the small state (held at
no cost) and an update call that updates weights and slots in place
(`keras_memfit/backend/tensorflow/training.py`). Checked against plain
Keras's own jit-compiled `fit`:

- the same weights, optimizer variables and iterations, for the optimizer
  variants of `test_tf_step_order` (weight decay, clipping, gradient
  accumulation, EMA, mixed precision, a sparse Embedding gradient);
- the footprint regression guard of issue #20: at a width where plain Keras
  trains under the capped allocator (`benchmarks/footprint.py`, "fit-jit":
  plain trains up to 12,248 at 500 MiB, MemFit's held fused step up to
  10,904), MemFit trains too, without adapting, to plain Keras's weights.
  Each variant runs in its own capped child process.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest

keras = pytest.importorskip("keras")

BACKEND = keras.backend.backend()

pytestmark = [
    pytest.mark.tensorflow(reason="TensorFlow's XLA train step"),
    pytest.mark.skipif(BACKEND != "tensorflow" or importlib.util.find_spec("tensorflow") is None,
                       reason="TensorFlow's train step under XLA"),
]

from keras_memfit import MemFit  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = dict(rtol=1e-5, atol=1e-6)


def _jit(make):
    """`make()`'s model, its steps compiled with XLA (`jit_compile=True`)."""
    def build():
        model = make()
        model.jit_compile = True
        return model
    return build


def test_split_step_trains_what_plain_jit_fit_trains_for_every_optimizer_variant():
    from tests.test_tf_step_order import VARIANTS, _step, variant_data, variant_model

    for variant in VARIANTS:
        make, policy = variant_model(variant)
        keras.config.set_dtype_policy(policy)
        try:
            x, y = variant_data(variant)
            expected = _jit(make)()
            assert expected.jit_compile
            expected.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
            model = _jit(make)()
            model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                      callbacks=[MemFit()])
        finally:
            keras.config.set_dtype_policy("float32")
        assert _step(model).split, variant
        assert int(model.optimizer.iterations) == int(expected.optimizer.iterations) > 0, variant
        for got, want in zip(model.get_weights(), expected.get_weights()):
            np.testing.assert_allclose(got, want, **TOL, err_msg=variant)
        for got, want in zip(model.optimizer.variables, expected.optimizer.variables):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL, err_msg=variant)


# ------------------------------------------- footprint regression guard
CAP_MB = 500
WIDTH, BATCH = 11_600, 8  # between MemFit's old widest (10,904) and plain's (12,248)


def child_wide_fit():
    """Plain or MemFit (`MEMFIT_VARIANT`) jit `fit` of the wide MLP; weights to `MEMFIT_OUT`."""
    import keras_memfit

    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((1024,)),
        keras.layers.Dense(WIDTH, activation="relu"),
        keras.layers.Dense(1024),
    ])
    model.compile(keras.optimizers.Adam(), "mse", jit_compile=True)
    rng = np.random.default_rng(0)
    x = rng.random((2 * BATCH, 1024), dtype=np.float32)
    y = rng.random((2 * BATCH, 1024), dtype=np.float32)
    memfit = keras_memfit.MemFit() if os.environ["MEMFIT_VARIANT"] == "memfit" else None
    history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                        callbacks=[memfit] if memfit else [])
    if memfit is not None:
        assert not memfit.events, f"MemFit adapted: {memfit.events}"
    np.savez(os.environ["MEMFIT_OUT"], *model.get_weights(),
             iterations=int(model.optimizer.iterations), loss=history.history["loss"])
    print("trained")


def _capped(tmp_path, variant):
    from keras_memfit.app.env import capped_cpu_env

    out = str(tmp_path / f"{variant}.npz")
    env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2",
               MEMFIT_VARIANT=variant, MEMFIT_OUT=out, **capped_cpu_env(CAP_MB))
    target = f"{os.path.abspath(__file__)}:child_wide_fit"
    proc = subprocess.run([sys.executable, "-m", "tests.jax_support", target, "0"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "trained" in output, f"{variant}:\n{output[-4000:]}"
    return np.load(out)


def test_memfit_trains_under_xla_a_width_plain_keras_trains_under_the_cap(tmp_path):
    plain = _capped(tmp_path, "plain")
    memfit = _capped(tmp_path, "memfit")
    assert int(memfit["iterations"]) == int(plain["iterations"]) == 2
    np.testing.assert_allclose(memfit["loss"], plain["loss"], **TOL)
    names = [k for k in plain.files if k.startswith("arr_")]
    assert len(names) == 4
    for name in names:
        np.testing.assert_allclose(memfit[name], plain[name], **TOL, err_msg=name)


# ------------------------------------- a model's own train_step under XLA
SMALL_CAP_MB, ROWS, PART = 100, 8000, 1000  # 8000 rows need 125 MiB of activations


def _custom_model():
    import tensorflow as tf

    class Counted(keras.Model):
        """A model with its own `train_step` (Keras's, counting calls and rows)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.calls = keras.Variable(0, dtype="int32", trainable=False)
            self.rows = keras.Variable(0, dtype="int32", trainable=False)

        def train_step(self, data):
            self.calls.assign_add(1)
            self.rows.assign_add(tf.shape(data[0])[0])  # inside the compiled step
            return super().train_step(data)

    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(4096, activation="relu")(inputs)
    model = Counted(inputs, keras.layers.Dense(3, activation="softmax")(hidden))
    model.compile("sgd", "sparse_categorical_crossentropy", jit_compile=True)
    return model


def _rows_data():
    rng = np.random.default_rng(0)
    return rng.random((ROWS, 8), dtype=np.float32), rng.integers(0, 3, ROWS)


def child_custom_step_after_xla_oom():
    """A custom jit step: the whole batch runs out of memory, then a part trains."""
    import tensorflow as tf

    import keras_memfit
    from keras_memfit import backend

    x, y = _rows_data()
    model = _custom_model()
    step = backend.get().make_custom_train_step(model, (tf.constant(x), tf.constant(y)))
    try:
        step((tf.constant(x), tf.constant(y)))  # the whole batch: XLA runs out of memory
        raise AssertionError("the whole batch fitted: the cap is too high")
    except Exception as err:  # noqa: BLE001
        assert keras_memfit.is_oom_error(err), str(err)[:300]
    step((tf.constant(x[:PART]), tf.constant(y[:PART])))
    np.savez(os.environ["MEMFIT_OUT"], *model.get_weights(), calls=int(model.calls.numpy()),
             rows=int(model.rows.numpy()), iterations=int(model.optimizer.iterations))
    print("trained")


def test_an_xla_oom_of_a_custom_train_step_leaves_the_weights_intact(tmp_path):
    from keras_memfit.app.env import capped_cpu_env

    out = str(tmp_path / "custom.npz")
    env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2",
               MEMFIT_OUT=out, **capped_cpu_env(SMALL_CAP_MB))
    target = f"{os.path.abspath(__file__)}:child_custom_step_after_xla_oom"
    proc = subprocess.run([sys.executable, "-m", "tests.jax_support", target, "0"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "trained" in output, output[-4000:]
    got = np.load(out)
    # The failed call ran nothing (XLA allocates first) and freed nothing it held.
    assert (int(got["calls"]), int(got["rows"]), int(got["iterations"])) == (1, PART, 1)
    x, y = _rows_data()
    reference = _custom_model()  # plain Keras, uncapped: one step on the part
    reference.train_on_batch(x[:PART], y[:PART])
    want = reference.get_weights()
    names = [k for k in got.files if k.startswith("arr_")]
    assert len(names) == len(want)
    for name, expected in zip(names, want):
        np.testing.assert_allclose(got[name], expected, rtol=1e-4, atol=1e-6, err_msg=name)
