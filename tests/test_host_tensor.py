"""`keras_memfit.app.env.host_tensor`: inputs outside TensorFlow's capped CPU allocator.

Under `TF_CPU_BFC_MEM_LIMIT_IN_MB`, TensorFlow copies a numpy array it is
given into the capped allocator without checking the allocation: an array the
cap cannot hold kills the process (the Digit Recognizer notebook's kernel
died so, issue 21). `host_tensor` keeps the array in host memory, as a GPU's
inputs are, so that only what a device would hold counts against the cap.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from keras_memfit.app import env

CAP_MB = 100
ROWS = 50_000  # x 784 float32 = 150 MiB, more than the cap


def _images():
    return np.random.default_rng(0).random((ROWS, 784), dtype=np.float32)


def test_host_tensor_refuses_what_dlpack_cannot_hold():
    with pytest.raises(ValueError, match="numeric or bool.*received dtype <U1"):
        env.host_tensor(np.array(["a", "b"]))
    with pytest.raises(ValueError, match="received dtype object"):
        env.host_tensor(np.array([{}, None], dtype=object))


@pytest.mark.tensorflow(reason="host_tensor makes TensorFlow tensors")
def test_host_tensor_holds_the_values_in_a_copy():
    for array in (np.arange(12, dtype=np.float16).reshape(3, 4), np.array([True, False]),
                  np.arange(5), np.zeros((0, 3), np.float32), np.ones((2, 3))[:, ::2]):
        tensor = env.host_tensor(array)
        assert tensor.dtype.name == array.dtype.name and tuple(tensor.shape) == array.shape
        np.testing.assert_array_equal(tensor.numpy(), array)
    array = np.arange(4.0)
    tensor = env.host_tensor(array)
    array[0] = 7.0  # the tensor holds its own copy
    assert tensor.numpy()[0] == 0.0


@pytest.mark.tensorflow(reason="the premise: TensorFlow's unchecked copy into its capped allocator")
def test_a_numpy_array_larger_than_the_cap_kills_tensorflow():
    # Why host_tensor exists: no ResourceExhaustedError, the process dies.
    code = ("import numpy as np, tensorflow as tf\n"
            f"x = np.ones(({ROWS}, 784), np.float32)\n"
            "try:\n    tf.convert_to_tensor(x)\nexcept Exception as e:\n"
            "    print('raised', type(e).__name__)\nprint('survived')\n")
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", **env.capped_cpu_env(CAP_MB)))
    assert result.returncode < 0 and "survived" not in result.stdout, (
        result.returncode, result.stdout, result.stderr[-2000:])


@pytest.mark.tensorflow(reason="host_tensor makes TensorFlow tensors")
@pytest.mark.memory_cap(CAP_MB)
def test_fit_and_predict_inputs_larger_than_the_cap():
    import keras
    import tensorflow as tf

    from keras_memfit import MemFit, safe_predict

    def in_use():
        return tf.config.experimental.get_memory_info("CPU:0")["current"]

    x = _images()
    y = np.random.default_rng(1).integers(0, 10, ROWS)
    x_host = env.host_tensor(x)
    assert in_use() < 2**20  # 150 MiB held, none of it in the 100 MiB cap
    np.testing.assert_array_equal(x_host[-3:].numpy(), x[-3:])

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(10)])
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(x_host, y, batch_size=256, epochs=1, steps_per_epoch=4,
                        validation_split=0.1, verbose=0, callbacks=[MemFit()])
    assert np.isfinite(history.history["val_loss"][0])
    # The plain predict of everything at once really runs out of memory (and raises).
    with pytest.raises(tf.errors.ResourceExhaustedError):
        model.predict(x_host, batch_size=ROWS, verbose=0)
    # safe_predict returns what plain Keras returns at a batch that fits.
    got = safe_predict(model, x_host, batch_size=ROWS)
    expected = np.concatenate([model.predict(x[i:i + 5000], batch_size=5000, verbose=0)
                               for i in range(0, ROWS, 5000)])
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
