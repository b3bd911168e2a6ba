"""MemFit's conformance matrix: models x Keras options x {no pressure, pressure}.

The reference is always plain Keras, never keras_memfit's output:

- no pressure: the same `fit` without MemFit. History, weights and the
  optimizer's iterations must be bitwise equal.
- pressure: every batch split by injected OOMs (`inject_oom`, conftest.py),
  against the same `fit` without MemFit and without OOMs: the same training
  within rounding (the optimizer steps, weights and History), or the
  documented `OutOfMemoryError` where a batch cannot be split (a stateful
  model).

Every model runs with Keras's defaults; the options run on two models (a
functional one with skip connections and a subclassed one), so that each
model and each option is met at least once while CI stays fast. An option
the active backend lacks skips with its reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Dict, Optional

import keras
import numpy as np
import pytest

from keras_memfit import MemFit, OutOfMemoryError
from support import BACKEND, keras_trains_stateful_rnns, oom_error

SEED = 5
N, BATCH, FEATURES, CLASSES = 48, 16, 6, 3
THRESHOLD = 5  # rows above which a step runs out of memory: every batch splits
# Under pressure: the same training as the unsplit batch up to float rounding.
RTOL, ATOL = 1e-5, 2e-6


# --------------------------------------------------------------------------
# Models: each `build(loss_outputs)` returns an uncompiled model
# --------------------------------------------------------------------------
def _sequential():
    return keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(8, activation="relu"),
        keras.layers.Dense(8, activation="relu"),
        keras.layers.Dense(CLASSES, activation="softmax"),
    ])


def _functional():
    inputs = keras.Input((FEATURES,))
    x = keras.layers.Dense(8, activation="relu")(inputs)
    x = keras.layers.Dense(8, activation="relu")(x)
    return keras.Model(inputs, keras.layers.Dense(CLASSES, activation="softmax")(x))


def _skips():
    inputs = keras.Input((FEATURES,))
    a = keras.layers.Dense(8, activation="relu")(inputs)
    b = keras.layers.Dense(8, activation="relu")(a)
    c = keras.layers.Add()([a, b])
    d = keras.layers.Dense(8, activation="relu")(c)
    x = keras.layers.Concatenate()([d, a])
    return keras.Model(inputs, keras.layers.Dense(CLASSES, activation="softmax")(x))


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.more = keras.layers.Dense(8, activation="relu")
        self.out = keras.layers.Dense(CLASSES, activation="softmax")

    def call(self, x):
        h = self.hidden(x)
        return self.out(h + self.more(h))


def _subclassed():
    model = Subclassed()
    model(np.zeros((1, FEATURES), "float32"))
    return model


def _nested():
    inner = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(8, activation="relu")], name="inner")
    inputs = keras.Input((FEATURES,))
    x = inner(keras.layers.Dense(8, activation="relu")(inputs))
    return keras.Model(inputs, keras.layers.Dense(CLASSES, activation="softmax")(x))


def _stateful():
    inputs = keras.Input(batch_shape=(BATCH, 2, FEATURES // 2))
    x = keras.layers.LSTM(8, stateful=True, name="stateful_lstm")(inputs)
    return keras.Model(inputs, keras.layers.Dense(CLASSES, activation="softmax")(x))


def _two_outputs():
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    return keras.Model(inputs, {
        "reg": keras.layers.Dense(1, name="reg")(hidden),
        "cls": keras.layers.Dense(CLASSES, activation="softmax", name="cls")(hidden),
    })


MODELS: Dict[str, Callable[[], keras.Model]] = {
    "sequential": _sequential,
    "functional": _functional,
    "skips": _skips,
    "subclassed": _subclassed,
    "nested": _nested,
    "stateful": _stateful,
}


# --------------------------------------------------------------------------
# Options: what a user passes to compile and fit
# --------------------------------------------------------------------------
@dataclasses.dataclass
class Option:
    optimizer: Callable[[], Any] = lambda: keras.optimizers.Adam(0.01)
    loss: Any = "sparse_categorical_crossentropy"
    compile: Callable[[], Dict[str, Any]] = dict  # fresh metric objects for each fit
    fit: Dict[str, Any] = dataclasses.field(default_factory=dict)
    callbacks: Callable[[Any], list] = lambda tmp: []
    model: Optional[Callable[[], keras.Model]] = None  # instead of the case's model
    policy: Optional[str] = None  # a dtype policy set while the model is built and fit
    skip: Dict[str, str] = dataclasses.field(default_factory=dict)  # backend -> reason
    data: str = "classes"  # "classes", "one_hot", "sample_weight" or "two_outputs"
    tolerance: tuple = (RTOL, ATOL)  # under pressure: the rounding of a split batch's sums


def _callbacks(tmp):
    return [
        keras.callbacks.EarlyStopping(monitor="val_loss", patience=5),
        keras.callbacks.ReduceLROnPlateau(monitor="val_loss", patience=1, factor=0.5),
        keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 0.9),
        keras.callbacks.ModelCheckpoint(str(tmp / "best.keras"), save_best_only=True),
        keras.callbacks.CSVLogger(str(tmp / "log.csv")),
    ]


_NO_TORCH_JIT = {"torch": "jit_compile: Keras's torch trainer compiles with torch.compile, "
                          "which this suite does not cover"}
_NO_TORCH_MULTI_STEP = {"torch": "steps_per_execution > 1: Keras's torch trainer refuses it"}

OPTIONS: Dict[str, Option] = {
    "default": Option(),
    "sgd_momentum": Option(optimizer=lambda: keras.optimizers.SGD(0.05, momentum=0.9)),
    "global_clipnorm": Option(optimizer=lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.1)),
    "clipnorm": Option(optimizer=lambda: keras.optimizers.SGD(0.05, clipnorm=0.05)),
    "use_ema": Option(optimizer=lambda: keras.optimizers.Adam(0.01, use_ema=True)),
    "gradient_accumulation": Option(
        optimizer=lambda: keras.optimizers.SGD(0.05, gradient_accumulation_steps=2)),
    "jit_compile": Option(compile=lambda: {"jit_compile": True}, skip=_NO_TORCH_JIT),
    "run_eagerly": Option(compile=lambda: {"run_eagerly": True}),
    "steps_per_execution": Option(compile=lambda: {"steps_per_execution": 2},
                                  skip=_NO_TORCH_MULTI_STEP),
    "class_weight": Option(fit={"class_weight": {0: 0.5, 1: 2.0, 2: 1.0}}),
    "sample_weight": Option(data="sample_weight"),
    "regularizers": Option(model=lambda: _regularized()),
    "metrics": Option(compile=lambda: {"metrics": [
                          "accuracy", keras.metrics.AUC(name="auc"),
                          keras.metrics.F1Score(average="macro")]},
                      loss="categorical_crossentropy", data="one_hot"),
    "callbacks": Option(callbacks=_callbacks, fit={"epochs": 3}),
    # SGD: Adam turns float16's rounding of a split batch's gradient into whole steps.
    "mixed_float16": Option(optimizer=lambda: keras.optimizers.SGD(0.05),
                            policy="mixed_float16", tolerance=(1e-3, 1e-4)),
    "loss_sum": Option(loss=lambda: keras.losses.SparseCategoricalCrossentropy(reduction="sum")),
    "loss_mean_with_sample_weight": Option(
        loss=lambda: keras.losses.SparseCategoricalCrossentropy(
            reduction="mean_with_sample_weight"), data="sample_weight"),
    "loss_weights": Option(
        model=_two_outputs, data="two_outputs",
        loss={"reg": "mse", "cls": "sparse_categorical_crossentropy"},
        compile=lambda: {"loss_weights": {"reg": 0.5, "cls": 2.0}}),
}


class _Penalty(keras.layers.Layer):
    """Adds a penalty on the mean activation with `add_loss`."""

    def call(self, x):
        self.add_loss(1e-2 * keras.ops.mean(keras.ops.square(x)))
        return x


def _regularized():
    inputs = keras.Input((FEATURES,))
    x = keras.layers.Dense(8, activation="relu", kernel_regularizer=keras.regularizers.L2(1e-2),
                           bias_regularizer=keras.regularizers.L1(1e-2),
                           activity_regularizer=keras.regularizers.L2(1e-2))(inputs)
    x = _Penalty()(x)
    return keras.Model(inputs, keras.layers.Dense(CLASSES, activation="softmax")(x))


CASES = [(model, "default") for model in MODELS if model != "stateful"] + [
    pytest.param("stateful", "default", marks=keras_trains_stateful_rnns)] + [
    (model, option) for option in OPTIONS if option != "default"
    for model in (("two_outputs",) if OPTIONS[option].model is _two_outputs
                  else ("skips",) if OPTIONS[option].model is not None
                  else ("skips", "subclassed"))
]


# --------------------------------------------------------------------------
# Running a case
# --------------------------------------------------------------------------
def _data(option: Option):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, FEATURES)).astype("float32")
    labels = rng.integers(0, CLASSES, size=N)
    weights = rng.uniform(0.2, 2.0, size=N).astype("float32")
    if option.data == "two_outputs":
        return {"x": x, "y": {"reg": rng.normal(size=(N, 1)).astype("float32"), "cls": labels}}
    if option.data == "one_hot":
        return {"x": x, "y": np.eye(CLASSES, dtype="float32")[labels]}
    if option.data == "sample_weight":
        return {"x": x, "y": labels, "sample_weight": weights}
    return {"x": x, "y": labels}


@contextlib.contextmanager
def _policy(name: Optional[str]):
    if name is None:
        yield
        return
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(name)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous)


def _fit(model_name: str, option: Option, tmp_path, memfit: Optional[MemFit],
         keras_step_fails: bool = False):
    """A fresh model of the case fit once; returns (model, History).

    `keras_step_fails`: Keras's own train function runs out of memory (the
    one a stateful model's batches run through).
    """
    keras.utils.set_random_seed(SEED)
    with _policy(option.policy):
        model = (option.model or MODELS[model_name])()
        loss = option.loss() if callable(option.loss) else option.loss
        model.compile(optimizer=option.optimizer(), loss=loss, **option.compile())
        data = _data(option)
        if model_name == "stateful":
            data["x"] = data["x"].reshape(N, 2, FEATURES // 2)
        if keras_step_fails:
            model.train_function = _out_of_memory
        fit_kwargs = dict(batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        if "sample_weight" not in data and option.data != "two_outputs":
            fit_kwargs["validation_split"] = 1 / 3
        fit_kwargs.update(option.fit)
        run_dir = tmp_path / ("memfit" if memfit else "plain")
        run_dir.mkdir(exist_ok=True)
        callbacks = option.callbacks(run_dir) + ([memfit] if memfit else [])
        history = model.fit(**data, callbacks=callbacks, **fit_kwargs)
    return model, history


def _out_of_memory(*args):
    raise oom_error(BATCH)


def _state(model, history):
    weights = [np.asarray(w) for w in model.get_weights()]
    return weights, int(model.optimizer.iterations), history.history


def _skip_if_unavailable(option: Option):
    if BACKEND in option.skip:
        pytest.skip(option.skip[BACKEND])


@pytest.mark.parametrize("model_name, option_name", CASES)
def test_with_no_pressure_fit_is_bitwise_kerass(model_name, option_name, tmp_path, inject_oom):
    option = OPTIONS[option_name]
    _skip_if_unavailable(option)
    inject_oom(None)
    weights, iterations, history = _state(*_fit(model_name, option, tmp_path, None))
    memfit = MemFit()
    got_weights, got_iterations, got_history = _state(*_fit(model_name, option, tmp_path, memfit))
    assert memfit.events == []
    assert got_iterations == iterations
    assert list(got_history) == list(history)
    for key in history:
        np.testing.assert_array_equal(got_history[key], history[key], err_msg=key)
    for i, (got, expected) in enumerate(zip(got_weights, weights)):
        np.testing.assert_array_equal(got, expected, err_msg=f"weight {i}")


@pytest.mark.parametrize("model_name, option_name", CASES)
def test_under_pressure_fit_is_kerass_unsplit_training(model_name, option_name, tmp_path,
                                                      inject_oom):
    option = OPTIONS[option_name]
    _skip_if_unavailable(option)
    inject_oom(None)
    weights, iterations, history = _state(*_fit(model_name, option, tmp_path, None))
    inject_oom(THRESHOLD)
    memfit = MemFit()
    if model_name == "stateful":  # a stateful model's batch cannot be split: refused, documented
        with pytest.raises(OutOfMemoryError) as raised:
            _fit(model_name, option, tmp_path, memfit, keras_step_fails=True)
        assert raised.value.cause == "cannot_split" and "stateful_lstm" in str(raised.value)
        return
    got_weights, got_iterations, got_history = _state(*_fit(model_name, option, tmp_path, memfit))
    assert inject_oom.ooms("train"), "no batch was split: the case tests nothing"
    assert got_iterations == iterations
    rtol, atol = option.tolerance
    for key in history:
        np.testing.assert_allclose(got_history[key], history[key], rtol=rtol, atol=atol,
                                   err_msg=key)
    for i, (got, expected) in enumerate(zip(got_weights, weights)):
        np.testing.assert_allclose(got, expected, rtol=rtol, atol=atol, err_msg=f"weight {i}")
