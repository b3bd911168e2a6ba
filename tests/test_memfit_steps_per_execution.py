"""`compile(steps_per_execution=k)` under memory pressure (issue 47, item 7).

Keras's multi-step function pulls each of its k batches when the step before
it is done; MemFit's function used to pull all k before running the first,
so each of its steps held k batches (at 85 MiB, where plain Keras trains the
digit CNN at batch 1, MemFit with k=4 at batch 256 paid 3 to 17 OOMs where
k=1 paid 2, and in two of three runs raised "even with a batch of a single
sample"). Now it pulls them one at a time: with k=4 each step starts with no
more memory in use than with k=1 (measured on TensorFlow's capped allocator,
whose statistics every machine reports), and the same cap costs the same OOMs.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

keras = pytest.importorskip("keras")

from support import BACKEND, wrap_factory  # noqa: E402

from keras_memfit import MemFit  # noqa: E402

pytestmark = pytest.mark.tensorflow(reason="memory statistics of TensorFlow's capped allocator")

BATCH = 512
ROW_BYTES = 28 * 28 * 4


def _cnn(steps_per_execution):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((28, 28, 1))
    h = keras.layers.Conv2D(8, 3, activation="relu")(inputs)
    h = keras.layers.Flatten()(keras.layers.MaxPooling2D()(h))
    model = keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(h))
    model.compile("adam", "sparse_categorical_crossentropy",
                  steps_per_execution=steps_per_execution)
    return model


class _Measured:
    """A train step that notes the memory in use when each call begins."""

    def __init__(self, step, seen):
        self._step, self._seen = step, seen

    def __getattr__(self, name):
        return getattr(self._step, name)

    def __call__(self, data):
        import tensorflow as tf

        self._seen.append(tf.config.experimental.get_memory_info("CPU:0")["current"])
        return self._step(data)


@pytest.mark.memory_cap(400)
def test_each_step_holds_one_pulled_batch_whatever_the_steps_per_execution(monkeypatch):
    rng = np.random.default_rng(0)
    x = rng.random((8 * BATCH, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, len(x))
    calls, seen = [], {}
    wrap_factory(monkeypatch, "make_train_step", lambda step: _Measured(step, calls))
    for steps in (1, 4):
        model = _cnn(steps)
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False,
                  callbacks=[MemFit()])
        seen[steps] = list(calls)
        calls.clear()
        del model
        gc.collect()
    assert len(seen[1]) == len(seen[4]) == 8
    # Four pulled batches held three more than one (6.2 MiB measured).
    assert max(seen[4]) - max(seen[1]) < BATCH * ROW_BYTES, {k: max(v) for k, v in seen.items()}
