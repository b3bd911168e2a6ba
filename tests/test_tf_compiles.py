"""TensorFlow with `jit_compile=True`: safe_predict compiles few shapes under a real OOM.

With `jit_compile=True` (which Keras turns on by itself on a GPU) XLA
compiles every new piece size. The child process runs under TensorFlow's
capped CPU allocator (real `ResourceExhaustedError`s, `app.env.capped_cpu_env`)
with XLA dumping every module it compiles (`tests/compile_count.py`), and
counts the oracle's compilations, plain `model.predict` at a batch that fits,
with the same counter: safe_predict's first call compiles at most one more,
its second none.
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


def test_jit_compiled_safe_predict_compiles_at_most_one_shape_more_than_keras(tmp_path):
    from keras_memfit.app.env import capped_cpu_env
    from tests.compile_count import tf_dump_env

    env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2",
               **capped_cpu_env(CAP_MB), **tf_dump_env(str(tmp_path / "xla")))
    target = f"{os.path.abspath(__file__)}:child_predict"
    proc = subprocess.run([sys.executable, "-m", "tests.jax_support", target, "0"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert "call 2: 0 compilations" in output, output[-3000:]
