"""MemFit as a Keras callback among others (issue 12, items 3, 7 and 9).

- It pickles and deep-copies, as Keras's own callbacks do, and the copy
  works in a fit.
- With a tf_keras (Keras 2) model it says that Keras 2 is not supported and
  what to do, instead of failing inside Keras 2's callback machinery.
- A batch MemFit cannot split runs through Keras's own step; only when that
  step runs out of memory does MemFit raise, naming what it received.
"""

from __future__ import annotations

import copy
import pickle

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_memfit import MemFit
from keras_memfit._internal.legacy import is_legacy_keras, legacy_keras_error, refuse
from support import requires_tensorflow

THRESHOLD = 5


def _data(n=48, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, 4)).astype("float32"),
            rng.integers(0, 3, size=n))


def _classifier():
    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(3, activation="softmax")])
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


# --------------------------------------------------------------------------
# Item 7: pickling and deep copies
# --------------------------------------------------------------------------
@pytest.mark.parametrize("duplicate", [
    lambda m: pickle.loads(pickle.dumps(m)), copy.deepcopy, copy.copy,
], ids=["pickle", "deepcopy", "copy"])
def test_memfit_copies_and_the_copy_works_in_a_fit(inject_oom, duplicate):
    memfit = duplicate(MemFit(mode="shrink", place=None))
    assert memfit.mode == "shrink" and memfit.events == []
    # The reference: Keras's own callbacks copy the same way.
    duplicate(keras.callbacks.EarlyStopping())
    x, y = _data()
    model = _classifier()
    inject_oom(THRESHOLD)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[memfit])
    assert inject_oom.ooms("train") and memfit.events
    assert max(inject_oom.ok_rows("train")) <= THRESHOLD


def test_memfit_pickles_after_a_fit_with_its_events(inject_oom):
    x, y = _data()
    model = _classifier()
    memfit = MemFit()
    inject_oom(THRESHOLD)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[memfit])
    inject_oom(None)
    memfit.set_model(None)  # as one would before pickling a callback alone
    copied = pickle.loads(pickle.dumps(memfit))
    assert copied.events == memfit.events and copied.events
    second = _classifier()
    history = second.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[copied])
    assert copied.events == [] and "loss" in history.history


# --------------------------------------------------------------------------
# Item 9: tf_keras (Keras 2) models
# --------------------------------------------------------------------------
def _keras2_model():
    """An object whose class comes from tf_keras, as a tf_keras model's does."""
    cls = type("Functional", (), {"__module__": "tf_keras.src.engine.functional"})
    return type("Sequential", (cls,), {"__module__": "tf_keras.src.engine.sequential"})()


def test_legacy_keras_error_names_tf_keras_and_the_fix():
    assert legacy_keras_error(_classifier()) is None
    assert legacy_keras_error(np.zeros(2)) is None
    message = legacy_keras_error(_keras2_model())
    assert is_legacy_keras(_keras2_model())
    for part in ("tf_keras", "Keras 2", "not supported", "Sequential", "import keras",
                 "TF_USE_LEGACY_KERAS"):
        assert part in message, part
    refuse(_classifier())
    with pytest.raises(TypeError) as info:
        refuse(_keras2_model())
    assert str(info.value) == message


def test_memfit_with_a_tf_keras_model_says_keras_2_is_not_supported():
    # What tf_keras's fit does with its callbacks (Keras 2's CallbackList):
    # set_model, then ask each callback which batch hooks it implements.
    memfit = MemFit()
    with pytest.raises(TypeError, match=r"tf_keras \(Keras 2\) is not supported"):
        memfit.set_model(_keras2_model())
    for hooks in ("_implements_train_batch_hooks", "_implements_test_batch_hooks",
                  "_implements_predict_batch_hooks"):
        with pytest.raises(TypeError, match="TF_USE_LEGACY_KERAS"):
            getattr(MemFit(), hooks)()


def test_memfit_in_keras_2s_own_callback_list_says_keras_2_is_not_supported():
    # TensorFlow still ships Keras 2's code (tf_keras is a copy of it); its
    # fit no longer runs on TF 2.21, but its CallbackList, which fit builds
    # first, does: without the check it fails with AttributeError:
    # 'MemFit' object has no attribute '_implements_train_batch_hooks'.
    keras2 = pytest.importorskip("tensorflow.python.keras")
    from tensorflow.python.keras.callbacks import CallbackList

    model = keras2.models.Sequential([keras2.layers.Dense(3, input_shape=(4,))])
    assert is_legacy_keras(model) and not isinstance(model, keras.Model)
    with pytest.raises(TypeError, match=r"tf_keras \(Keras 2\) is not supported"):
        CallbackList([MemFit()], add_history=True, model=model, epochs=1, steps=1,
                     verbose=0)


def test_memfit_still_accepts_keras_3_models():
    memfit = MemFit()
    model = _classifier()
    memfit.set_model(model)
    assert memfit.model is model


# --------------------------------------------------------------------------
# Item 3: an input MemFit cannot split, under OOM
# --------------------------------------------------------------------------
def _out_of_memory(*args, **kwargs):
    raise tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor")


@requires_tensorflow  # tf.SparseTensor input, TensorFlow's train_function(iterator)
def test_unsplittable_batch_that_runs_out_of_memory_names_what_was_received():
    inputs = keras.Input((4,), sparse=True)
    model = keras.Model(inputs, keras.layers.Dense(3)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    x = tf.sparse.from_dense(np.ones((8, 4), "float32"))
    y = np.zeros((8, 3), "float32")
    # Keras's own train function runs out of memory (fit makes it only when
    # there is none).
    model.train_function = _out_of_memory
    with pytest.raises(tf.errors.ResourceExhaustedError) as plain:
        model.fit(x, y, batch_size=8, verbose=0)
    assert "OOM when allocating" in str(plain.value)
    with pytest.raises(tf.errors.ResourceExhaustedError) as info:
        model.fit(x, y, batch_size=8, verbose=0, callbacks=[MemFit()])
    message = str(info.value)
    assert "cannot split" in message and "Received: x=SparseTensor(shape=(8, 4)" in message
    assert "float32" in message and model.name in message
    assert model.train_function is _out_of_memory  # Keras's own function back in place
