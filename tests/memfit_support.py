"""Data, models and references shared by MemFit's callback tests (test_callbacks.py, test_memfit_*.py).

Every exactness check compares with an independent reference: the same model
(same seed, so the same initial weights) fit by Keras *without* MemFit and
without injected OOMs, with `shuffle=False` (the "uncapped run"); see
`fit_pair` and `assert_same_training`.
"""

from __future__ import annotations


import keras
import numpy as np

from keras_memfit import MemFit
from support import (
    backend_module,
)

backend = backend_module()


RTOL = 1e-5
ATOL = 1e-6
SEED = 7
N = 48
FEATURES = 4
CLASSES = 3
BATCH = 16
THRESHOLD = 5  # below BATCH: every full batch runs out of memory
MEMFIT_KEYS = {"memfit_ooms", "memfit_split", "memfit_remat"}


# --------------------------------------------------------------------------
# Data, models, references
# --------------------------------------------------------------------------
def _data(n=N, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, size=n)
    w = rng.uniform(0.2, 2.0, size=n).astype("float32")
    return x, y, w


def _sgd():
    return keras.optimizers.SGD(learning_rate=0.1)


def _classifier(optimizer=_sgd, regularizer=None, model_class=keras.Sequential,
                loss="sparse_categorical_crossentropy", **compile_kwargs):
    """A small Dense classifier; same seed, so the same initial weights each call."""
    keras.utils.set_random_seed(SEED)
    model = model_class([
        keras.Input((FEATURES,)),
        keras.layers.Dense(8, activation="relu", kernel_regularizer=regularizer),
        keras.layers.Dense(CLASSES, activation="softmax"),
    ])
    compile_kwargs.setdefault("metrics", ["accuracy"])
    model.compile(optimizer=optimizer(), loss=loss, **compile_kwargs)
    return model


def _dict_input_model():
    keras.utils.set_random_seed(SEED)
    a = keras.Input((3,), name="a")
    b = keras.Input((2,), name="b")
    hidden = keras.layers.Dense(6, activation="relu")(a)
    joined = keras.layers.Concatenate()([hidden, b])
    out = keras.layers.Dense(CLASSES, activation="softmax")(joined)
    model = keras.Model({"a": a, "b": b}, out)
    model.compile(optimizer=_sgd(), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return model


def _two_output_model():
    keras.utils.set_random_seed(SEED)
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    reg = keras.layers.Dense(1, name="reg")(hidden)
    cls = keras.layers.Dense(CLASSES, activation="softmax", name="cls")(hidden)
    model = keras.Model(inputs, {"reg": reg, "cls": cls})
    model.compile(
        optimizer=_sgd(),
        loss={"reg": "mse", "cls": "sparse_categorical_crossentropy"},
        loss_weights={"reg": 0.5, "cls": 1.0},
        metrics={"reg": ["mae"], "cls": ["accuracy"]},
    )
    return model


def _fit_pair(build, inject_oom, fit_kwargs, threshold=THRESHOLD, phases=None,
              after=False, memfit=None):
    """(reference model, its History, MemFit model, its History, the MemFit).

    The reference is fit by Keras alone, with no injection; the MemFit model is
    built the same way and fit with MemFit under injected OOMs.
    """
    fit_kwargs = dict(fit_kwargs, verbose=0)
    fit_kwargs.setdefault("shuffle", False)
    reference = build()
    inject_oom(None)
    ref_history = reference.fit(**fit_kwargs)
    assert inject_oom.calls == [], "the reference run must not go through keras_memfit"
    model = build()
    memfit = memfit or MemFit()
    inject_oom(threshold, after=after, phases=phases)
    history = model.fit(callbacks=[memfit], **fit_kwargs)
    inject_oom(None)
    return reference, ref_history, model, history, memfit


def _optimizer_values(model):
    return [np.array(v) for v in model.optimizer.variables]


def _assert_same_training(reference, ref_history, model, history, keys=None):
    """Weights, optimizer state, iterations and History equal the uncapped run's.

    `keys`: the History entries to compare (default: every entry of the reference).
    """
    expected, actual = reference.get_weights(), model.get_weights()
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        np.testing.assert_allclose(a, e, rtol=RTOL, atol=ATOL, err_msg=f"weight {i}")
    assert int(model.optimizer.iterations) == int(reference.optimizer.iterations)
    exp_opt, act_opt = _optimizer_values(reference), _optimizer_values(model)
    assert len(act_opt) == len(exp_opt)
    for i, (a, e) in enumerate(zip(act_opt, exp_opt)):
        np.testing.assert_allclose(a, e, rtol=RTOL, atol=ATOL,
                                   err_msg=f"optimizer variable {i}")
    assert set(history.history) == set(ref_history.history) | MEMFIT_KEYS
    for key in ref_history.history if keys is None else keys:
        np.testing.assert_allclose(history.history[key], ref_history.history[key],
                                   rtol=RTOL, atol=ATOL, err_msg=key)


def _keras_functions(model):
    """Make (without running) and return Keras's own train/test/predict functions."""
    model.make_train_function()
    model.make_test_function()
    model.make_predict_function()
    functions = _installed_functions(model)
    assert all(f is not None for f in functions)
    return functions


def _installed_functions(model):
    return (model.train_function, model.test_function, model.predict_function)


def _assert_keras_functions(model, keras_functions, memfit):
    for name, actual, expected in zip(
        ("train_function", "test_function", "predict_function"),
        _installed_functions(model), keras_functions,
    ):
        assert getattr(actual, "__self__", None) is not memfit, f"{name} is still MemFit's"
        assert actual is expected, f"{name} is not Keras's own function"


class _Record(keras.callbacks.Callback):
    """Records the training state at the start of every train batch."""

    def __init__(self):
        super().__init__()
        self.epoch = None
        self.batch = None
        self.weights = None
        self.iterations = None
        self.metrics = None
        self.optimizer = None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        self.batch = batch
        self.weights = self.model.get_weights()
        self.iterations = int(self.model.optimizer.iterations)
        self.metrics = [np.array(v) for v in self.model.metrics_variables]
        self.optimizer = _optimizer_values(self.model)
