"""MemFit, the `model.fit` callback, against Keras's own uncapped training.

Every exactness check compares with an independent reference: the same model
(same seed, so the same initial weights) fit by Keras *without* MemFit and
without injected OOMs, with `shuffle=False` (the "uncapped run"). The MemFit
run gets OOMs from the `inject_oom` fixture (conftest.py): every compiled step
keras_memfit builds (full train steps, accumulated micro-batches, evaluate and
predict steps) raises a real OOM error of the active backend (`support.oom_error`) when its batch
has more rows than a threshold. In `mode="accumulate"` the final weights,
optimizer slots, `optimizer.iterations` and every History entry of the
reference must come out the same up to float rounding.

Models have no Dropout/BatchNormalization: those are documented as
per-micro-batch and so cannot be exact. Pattern: one behaviour per test, as
in keras/src/callbacks/*_test.py.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_memfit import MemFit, OutOfMemoryError
from keras_memfit.backend import base
from keras_memfit.planner import Event
from support import (
    multi_step_execution,
    BACKEND,
    Batches,
    CustomStepModel,
    backend_module,
    oom_error_class,
    requires_tensorflow,
    runtime_error,
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
MEMFIT_KEYS = {"memfit_ooms", "memfit_split"}


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


# --------------------------------------------------------------------------
# mode="accumulate": the same training as the uncapped run
# --------------------------------------------------------------------------
def test_accumulate_numpy_equals_uncapped_run(inject_oom):
    x, y, _ = _data()
    pair = _fit_pair(_classifier, inject_oom,
                     dict(x=x, y=y, batch_size=BATCH, epochs=2))
    assert inject_oom.ooms("train"), "no OOM was injected in training"
    _assert_same_training(*pair[:4])
    # One optimizer update per batch: 3 batches x 2 epochs.
    assert int(pair[2].optimizer.iterations) == 6


def test_accumulate_micro_batches_respect_the_threshold(inject_oom):
    x, y, _ = _data()
    _fit_pair(_classifier, inject_oom, dict(x=x, y=y, batch_size=BATCH, epochs=1))
    ok = inject_oom.ok_rows("train")
    assert ok and max(ok) <= THRESHOLD
    assert sum(ok) == N  # every sample in exactly one successful micro-batch


def test_accumulate_dict_inputs_of_multi_input_model(inject_oom):
    rng = np.random.default_rng(1)
    x = {"a": rng.normal(size=(N, 3)).astype("float32"),
         "b": rng.normal(size=(N, 2)).astype("float32")}
    y = rng.integers(0, CLASSES, size=N)
    pair = _fit_pair(_dict_input_model, inject_oom,
                     dict(x=x, y=y, batch_size=BATCH, epochs=2))
    assert inject_oom.ooms("train")
    _assert_same_training(*pair[:4])


def test_accumulate_multi_output_model_with_two_losses(inject_oom):
    x, y_cls, _ = _data()
    y_reg = np.random.default_rng(2).normal(size=(N, 1)).astype("float32")
    pair = _fit_pair(_two_output_model, inject_oom,
                     dict(x=x, y={"reg": y_reg, "cls": y_cls}, batch_size=BATCH, epochs=2))
    assert inject_oom.ooms("train")
    assert {"loss", "reg_loss", "cls_loss", "reg_mae", "cls_accuracy"} == set(pair[1].history)
    # Weights, slots, iterations, total loss and the compiled metrics.
    _assert_same_training(*pair[:4], keys=["loss", "reg_mae", "cls_accuracy"])


def test_accumulate_multi_output_per_output_losses(inject_oom):
    # FINDING (see the report): Keras updates the per-output loss trackers
    # (reg_loss, cls_loss) with sample_weight=y_pred.shape[0], the *static*
    # batch size: None once the micro-batch step is retraced for a new size,
    # so every micro-batch then counts as much as a full one (pieces of 5, 5,
    # 5, 1 after the planner grows from 4 to 5). History then differs from the
    # uncapped run although the weights are the same.
    x, y_cls, _ = _data()
    y_reg = np.random.default_rng(2).normal(size=(N, 1)).astype("float32")
    pair = _fit_pair(_two_output_model, inject_oom,
                     dict(x=x, y={"reg": y_reg, "cls": y_cls}, batch_size=BATCH, epochs=2))
    assert inject_oom.ooms("train")
    _assert_same_training(*pair[:4], keys=["reg_loss", "cls_loss"])


def test_multi_output_per_output_val_losses_under_validation_oom(inject_oom):
    # FINDING, as above, for validation: the per-output loss trackers
    # (val_reg_loss, val_cls_loss) when only the validation batches are split;
    # 14 validation rows: pieces of 3, 3, 3, 3, 2.
    x, y_cls, _ = _data()
    y_reg = np.random.default_rng(2).normal(size=(N, 1)).astype("float32")
    xv, yv_cls, _ = _data(n=14, seed=5)
    yv_reg = np.random.default_rng(3).normal(size=(14, 1)).astype("float32")
    pair = _fit_pair(_two_output_model, inject_oom,
                     dict(x=x, y={"reg": y_reg, "cls": y_cls}, batch_size=BATCH, epochs=1,
                          validation_data=(xv, {"reg": yv_reg, "cls": yv_cls}),
                          validation_batch_size=14),
                     phases=("evaluate",))
    assert inject_oom.ooms("evaluate") and not inject_oom.ooms("train")
    _assert_same_training(*pair[:4])


def test_accumulate_tf_data_dataset(inject_oom):
    x, y, _ = _data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    pair = _fit_pair(_classifier, inject_oom, dict(x=dataset, epochs=2))
    assert inject_oom.ooms("train")
    _assert_same_training(*pair[:4])


def test_accumulate_py_dataset(inject_oom):
    x, y, _ = _data(n=40)  # last batch of 8 rows
    pair = _fit_pair(_classifier, inject_oom, dict(x=Batches(x, y, BATCH), epochs=2))
    assert inject_oom.ooms("train")
    _assert_same_training(*pair[:4])


def test_accumulate_sample_weight(inject_oom):
    x, y, w = _data()
    build = lambda: _classifier(weighted_metrics=["accuracy"])  # noqa: E731
    pair = _fit_pair(build, inject_oom,
                     dict(x=x, y=y, sample_weight=w, batch_size=BATCH, epochs=2))
    assert inject_oom.ooms("train")
    _assert_same_training(*pair[:4])


def test_accumulate_class_weight(inject_oom):
    x, y, _ = _data()
    pair = _fit_pair(_classifier, inject_oom,
                     dict(x=x, y=y, class_weight={0: 1.0, 1: 3.0, 2: 0.5},
                          batch_size=BATCH, epochs=2))
    assert inject_oom.ooms("train")
    _assert_same_training(*pair[:4])


def test_accumulate_validation_split(inject_oom):
    x, y, _ = _data(n=64)  # 48 train rows, 16 validation rows
    pair = _fit_pair(_classifier, inject_oom,
                     dict(x=x, y=y, validation_split=0.25, batch_size=BATCH, epochs=2))
    assert inject_oom.ooms("train")
    assert inject_oom.ooms("evaluate"), "validation batches should run out of memory too"
    assert {"val_loss", "val_accuracy"} <= set(pair[1].history)
    _assert_same_training(*pair[:4])


def test_accumulate_validation_data(inject_oom):
    x, y, _ = _data()
    xv, yv, _ = _data(n=24, seed=5)
    pair = _fit_pair(_classifier, inject_oom,
                     dict(x=x, y=y, validation_data=(xv, yv), batch_size=BATCH, epochs=2))
    assert inject_oom.ooms("train")
    assert inject_oom.ooms("evaluate")
    _assert_same_training(*pair[:4])


@multi_step_execution
def test_accumulate_steps_per_execution(inject_oom):
    x, y, _ = _data(n=80)  # 5 batches: one execution of 3, one of 2
    build = lambda: _classifier(steps_per_execution=3)  # noqa: E731
    pair = _fit_pair(build, inject_oom, dict(x=x, y=y, batch_size=BATCH, epochs=2))
    assert inject_oom.ooms("train")
    _assert_same_training(*pair[:4])
    assert int(pair[2].optimizer.iterations) == 10


def test_accumulate_initial_epoch(inject_oom):
    x, y, _ = _data()
    pair = _fit_pair(_classifier, inject_oom,
                     dict(x=x, y=y, batch_size=BATCH, epochs=3, initial_epoch=1))
    assert inject_oom.ooms("train")
    assert len(pair[3].history["loss"]) == 2
    assert len(pair[3].history["memfit_ooms"]) == 2
    _assert_same_training(*pair[:4])


def test_accumulate_learning_rate_schedule_with_adam(inject_oom):
    # The schedule reads optimizer.iterations: a step per micro-batch would
    # decay the learning rate too fast, and Adam's bias correction would differ.
    def adam():
        schedule = keras.optimizers.schedules.ExponentialDecay(
            0.05, decay_steps=2, decay_rate=0.5)
        return keras.optimizers.Adam(learning_rate=schedule)

    x, y, _ = _data()
    pair = _fit_pair(lambda: _classifier(optimizer=adam), inject_oom,
                     dict(x=x, y=y, batch_size=BATCH, epochs=2))
    assert inject_oom.ooms("train")
    _assert_same_training(*pair[:4])


def test_accumulate_sgd_with_momentum(inject_oom):
    momentum = lambda: keras.optimizers.SGD(learning_rate=0.1, momentum=0.9)  # noqa: E731
    x, y, _ = _data()
    pair = _fit_pair(lambda: _classifier(optimizer=momentum), inject_oom,
                     dict(x=x, y=y, batch_size=BATCH, epochs=2))
    assert inject_oom.ooms("train")
    _assert_same_training(*pair[:4])


def test_accumulate_kernel_regularizer(inject_oom):
    # model.losses is added once per micro-batch, weighted by its share of rows.
    build = lambda: _classifier(regularizer=keras.regularizers.L2(0.05))  # noqa: E731
    x, y, _ = _data()
    pair = _fit_pair(build, inject_oom, dict(x=x, y=y, batch_size=BATCH, epochs=2))
    assert pair[0].losses, "the model should have regularization losses"
    assert inject_oom.ooms("train")
    _assert_same_training(*pair[:4])


def test_exactness_check_can_fail(inject_oom):
    """Sanity check: a run that is not the uncapped run is caught (shrink mode
    takes one optimizer step per piece, so it is a different training)."""
    x, y, _ = _data()
    reference, ref_history, model, history, _ = _fit_pair(
        _classifier, inject_oom, dict(x=x, y=y, batch_size=BATCH, epochs=1),
        memfit=MemFit(mode="shrink"))
    assert inject_oom.ooms("train")
    with pytest.raises(AssertionError):
        _assert_same_training(reference, ref_history, model, history)


# --------------------------------------------------------------------------
# OOM only in validation; OOM after the full train step ran
# --------------------------------------------------------------------------
def test_oom_only_in_validation(inject_oom):
    x, y, _ = _data()
    xv, yv, _ = _data(n=24, seed=5)
    pair = _fit_pair(_classifier, inject_oom,
                     dict(x=x, y=y, validation_data=(xv, yv), batch_size=BATCH, epochs=2),
                     phases=("evaluate",))
    memfit = pair[4]
    assert inject_oom.ooms("evaluate")
    assert inject_oom.ooms("train") == []
    train_rows = inject_oom.rows("train")
    assert train_rows == [BATCH] * 6  # full batches only: training untouched
    assert memfit.events and {e["phase"] for e in memfit.events} == {"evaluate"}
    assert pair[3].history["memfit_split"] == [1, 1]  # training batches never split
    _assert_same_training(*pair[:4])


@requires_tensorflow  # on JAX a step writes nothing unless its whole computation succeeded
def test_oom_after_full_train_step_refuses_to_retry_and_restores_small_state(inject_oom):
    # after=True: the real step ran (weights, slots, iterations, metrics all
    # updated) and then the OOM was raised, as an OOM inside the optimizer
    # update would be. Retrying would update the weights twice, so MemFit
    # raises OutOfMemoryError; the small state (iterations, metric counts) is
    # rolled back to what it was before the step.
    x, y, _ = _data()
    model = _classifier()
    inject_oom(THRESHOLD, after=True, phases=("train",))
    with pytest.raises(OutOfMemoryError) as info:
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=[MemFit()])
    assert "optimizer update" in str(info.value)
    assert int(model.optimizer.iterations) == 0
    counts = [float(np.array(v)) for v in model.metrics_variables if "count" in v.name]
    assert counts and all(c == 0 for c in counts)
    assert len(inject_oom.ooms("train")) == 1  # no retry


def test_oom_after_full_train_step_does_not_update_weights_twice(inject_oom):
    # FINDING (see the report): a full train step whose OOM comes after its
    # optimizer update (e.g. an OOM inside apply_gradients, or reported late)
    # has already updated the weights and slots; VariableGuard restores only
    # the small state, and the accumulated retry then updates them again. The
    # docstring says an OOM in the optimizer update raises OutOfMemoryError;
    # on the full-step path it is silently retried instead (the weights come
    # out exactly as after two plain SGD steps on the first batch). Either the
    # result is the uncapped run's, or MemFit refuses with the documented
    # OutOfMemoryError for an OOM in the optimizer update.
    x, y, _ = _data()
    reference = _classifier()
    reference.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    model = _classifier()
    inject_oom(THRESHOLD, after=True, phases=("train",))
    try:
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=[MemFit()])
    except OutOfMemoryError as err:
        assert "optimizer update" in str(err)
        return
    assert inject_oom.ooms("train")
    for i, (a, e) in enumerate(zip(model.get_weights(), reference.get_weights())):
        np.testing.assert_allclose(a, e, rtol=RTOL, atol=ATOL, err_msg=f"weight {i}")


# --------------------------------------------------------------------------
# mode="shrink"
# --------------------------------------------------------------------------
def test_shrink_counts_one_iteration_per_piece(inject_oom):
    x, y, _ = _data()
    model = _classifier()
    inject_oom(THRESHOLD)
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                        callbacks=[MemFit(mode="shrink")])
    assert inject_oom.ooms("train")
    pieces = inject_oom.ok_rows("train")
    assert max(pieces) <= THRESHOLD and sum(pieces) == 2 * N
    assert int(model.optimizer.iterations) == len(pieces)
    assert len(history.history["loss"]) == 2
    assert all(np.isfinite(history.history["loss"]))


def test_shrink_with_custom_train_step_equals_smaller_batch_size(inject_oom):
    # Pieces of 8 (16 fails, 8 fits; growth to 11 fails and freezes at 8):
    # the same training as Keras with batch_size=8.
    build = lambda: _classifier(model_class=CustomStepModel)  # noqa: E731
    x, y, _ = _data(n=64)
    reference = build()
    ref_history = reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    model = build()
    inject_oom(8)
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                        callbacks=[MemFit(mode="shrink")])
    assert inject_oom.ooms("train")
    pieces = inject_oom.ok_rows("train")
    assert set(pieces) == {8}
    assert int(model.optimizer.iterations) == len(pieces) == 16
    _assert_same_training(reference, ref_history, model, history)


def test_accumulate_with_custom_train_step_trains_as_shrink_with_a_warning(inject_oom, caplog):
    # Issue 12: a custom train_step no longer raises at the start of fit; under
    # OOM, mode="accumulate" trains it as mode="shrink" (the reference: Keras
    # at the batch size that fits), and says so once, at the first OOM.
    build = lambda: _classifier(model_class=CustomStepModel)  # noqa: E731
    x, y, _ = _data(n=64)
    reference = build()
    ref_history = reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    model = build()
    inject_oom(8)
    with caplog.at_level(logging.WARNING, logger="keras_memfit"):
        history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                            callbacks=[MemFit()])
    assert inject_oom.ooms("train")
    _assert_same_training(reference, ref_history, model, history)
    fallback = [r for r in caplog.records if "mode='shrink'" in r.getMessage()]
    assert len(fallback) == 1
    assert "CustomStepModel" in fallback[0].getMessage()


def test_accumulate_with_custom_train_step_says_nothing_without_oom(inject_oom, caplog):
    model = _classifier(model_class=CustomStepModel)
    x, y, _ = _data()
    with caplog.at_level(logging.DEBUG, logger="keras_memfit"):
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[MemFit()])
    assert [r.getMessage() for r in caplog.records if r.name == "keras_memfit"] == []


def test_sum_reduction_trains_as_shrink_with_a_warning(inject_oom, caplog):
    build = lambda: _classifier(  # noqa: E731
        loss=keras.losses.SparseCategoricalCrossentropy(reduction="sum"))
    x, y, _ = _data(n=64)
    reference = build()
    ref_history = reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    model = build()
    inject_oom(8)
    with caplog.at_level(logging.WARNING, logger="keras_memfit"):
        history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                            callbacks=[MemFit()])
    assert inject_oom.ooms("train")
    _assert_same_training(reference, ref_history, model, history)
    fallback = [r for r in caplog.records if "mode='shrink'" in r.getMessage()]
    assert len(fallback) == 1 and "sum" in fallback[0].getMessage()


def test_invalid_mode():
    with pytest.raises(ValueError, match="mode"):
        MemFit(mode="bogus")


@pytest.mark.parametrize("place", ["yes", {"budjet": 1}, ["emb"], 3])
def test_invalid_place_names_what_was_received(place):
    with pytest.raises(ValueError, match=r"place must be(.|\n)*received place=" + re.escape(repr(place))):
        MemFit(place=place)



# --------------------------------------------------------------------------
# Keras's functions come back
# --------------------------------------------------------------------------
def test_functions_restored_after_fit_returns(inject_oom):
    x, y, _ = _data()
    model = _classifier()
    keras_functions = _keras_functions(model)
    memfit = MemFit()
    inject_oom(THRESHOLD)
    model.fit(x, y, validation_data=(x[:24], y[:24]), batch_size=BATCH, epochs=1,
              verbose=0, callbacks=[memfit])
    assert inject_oom.ooms("train") and inject_oom.ooms("evaluate")
    _assert_keras_functions(model, keras_functions, memfit)


def test_functions_restored_after_non_oom_error_in_fit(inject_oom, monkeypatch):
    x, y, _ = _data()
    model = _classifier()
    keras_functions = _keras_functions(model)
    memfit = MemFit()
    add = backend.GradientAccumulator.add

    def failing_add(self, data, weight):
        raise runtime_error("not an OOM")

    monkeypatch.setattr(backend.GradientAccumulator, "add", failing_add)
    inject_oom(THRESHOLD)
    with pytest.raises(type(runtime_error(""))):
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[memfit])
    monkeypatch.setattr(backend.GradientAccumulator, "add", add)
    _assert_keras_functions(model, keras_functions, memfit)


class _RaiseAtEpochEnd(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        raise RuntimeError("callback failed")


def test_functions_restored_after_callback_raises_in_on_epoch_end(inject_oom):
    # FINDING (see the report): MemFit gets no hook when another callback
    # raises; its train/test functions stay installed on the model.
    x, y, _ = _data()
    model = _classifier()
    keras_functions = _keras_functions(model)
    memfit = MemFit()
    inject_oom(THRESHOLD)
    with pytest.raises(RuntimeError, match="callback failed"):
        model.fit(x, y, validation_data=(x[:24], y[:24]), batch_size=BATCH, epochs=2,
                  verbose=0, callbacks=[memfit, _RaiseAtEpochEnd()])
    _assert_keras_functions(model, keras_functions, memfit)


def _fit_that_raises_in_on_epoch_end(model, injector):
    x, y, _ = _data()
    injector(THRESHOLD)
    with pytest.raises(RuntimeError, match="callback failed"):
        model.fit(x, y, validation_data=(x[:24], y[:24]), batch_size=BATCH, epochs=2,
                  verbose=0, shuffle=False, callbacks=[MemFit(), _RaiseAtEpochEnd()])
    assert injector.ooms("train")
    injector(None)
    injector.calls.clear()


def test_plain_fit_after_memfit_fit_raised_does_not_use_memfit(inject_oom):
    x, y, _ = _data()
    model = _classifier()
    _fit_that_raises_in_on_epoch_end(model, inject_oom)
    history = model.fit(x, y, validation_data=(x[:24], y[:24]), batch_size=BATCH,
                        epochs=1, verbose=0, shuffle=False)
    model.predict(x, batch_size=BATCH, verbose=0)
    assert not MEMFIT_KEYS & set(history.history)
    assert inject_oom.calls == [], "keras_memfit steps ran without MemFit"
    # The plain fit continued from the first epoch's weights: two epochs in all.
    reference = _classifier()
    reference.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False)
    for a, e in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, e, rtol=RTOL, atol=ATOL)


def test_plain_evaluate_after_memfit_fit_raised_does_not_use_memfit(inject_oom):
    # FINDING (see the report): the left-behind train_function notices a later
    # fit (model.history changed) and steps aside; the left-behind
    # test_function has no such check, so a plain evaluate runs MemFit's steps.
    x, y, _ = _data()
    model = _classifier()
    _fit_that_raises_in_on_epoch_end(model, inject_oom)
    model.evaluate(x, y, batch_size=BATCH, verbose=0)
    assert inject_oom.calls == [], "evaluate without MemFit ran keras_memfit steps"


def test_plain_fit_after_memfit_fit_does_not_use_memfit(inject_oom):
    x, y, _ = _data()
    model = _classifier()
    inject_oom(THRESHOLD)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[MemFit()])
    inject_oom(None)
    inject_oom.calls.clear()
    history = model.fit(x, y, validation_data=(x[:24], y[:24]), batch_size=BATCH,
                        epochs=1, verbose=0)
    assert not MEMFIT_KEYS & set(history.history)
    assert inject_oom.calls == []
    assert np.isfinite(history.history["loss"][0])


# --------------------------------------------------------------------------
# Errors during a retry
# --------------------------------------------------------------------------
@pytest.mark.parametrize("error", [
    runtime_error("bad input (not an OOM)"),
    ValueError("not an OOM"),
], ids=["InvalidArgumentError", "ValueError"])
def test_non_oom_error_in_retry_propagates_unchanged(inject_oom, monkeypatch, error):
    x, y, _ = _data()
    model = _classifier()
    add = backend.GradientAccumulator.add  # the injector's
    calls = []

    def add_then_fail(self, data, weight):
        calls.append(weight)
        if len(calls) == 2:  # the first micro-batch after the 8-row one ran out
            raise error
        add(self, data, weight)

    monkeypatch.setattr(backend.GradientAccumulator, "add", add_then_fail)
    inject_oom(THRESHOLD)
    with pytest.raises(type(error)) as info:
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[MemFit()])
    assert info.value is error
    assert len(calls) == 2
    assert int(model.optimizer.iterations) == 0


def test_keyboard_interrupt_in_retry_leaves_the_step_undone(inject_oom, monkeypatch):
    x, y, _ = _data()
    model = _classifier(optimizer=lambda: keras.optimizers.SGD(0.1, momentum=0.9))
    record = _Record()
    add = backend.GradientAccumulator.add  # the injector's
    per_step = {}

    def add_then_interrupt(self, data, weight):
        key = (record.epoch, record.batch)
        per_step[key] = per_step.get(key, 0) + 1
        if key == (0, 1) and per_step[key] == 3:  # step 1, after two micro-batches ran
            raise KeyboardInterrupt
        add(self, data, weight)

    monkeypatch.setattr(backend.GradientAccumulator, "add", add_then_interrupt)
    inject_oom(THRESHOLD)
    with pytest.raises(KeyboardInterrupt):
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False,
                  callbacks=[record, MemFit()])
    assert (record.epoch, record.batch) == (0, 1)
    assert record.iterations == 1
    assert int(model.optimizer.iterations) == record.iterations
    for i, (a, e) in enumerate(zip(model.metrics_variables, record.metrics)):
        np.testing.assert_array_equal(np.array(a), e, err_msg=f"metric variable {i}")
    for a, e in zip(model.get_weights(), record.weights):
        np.testing.assert_array_equal(a, e)
    for a, e in zip(_optimizer_values(model), record.optimizer):
        np.testing.assert_array_equal(a, e)
    # The model is usable afterwards, without MemFit.
    monkeypatch.setattr(backend.GradientAccumulator, "add", add)
    inject_oom(None)
    inject_oom.calls.clear()
    history = model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    assert model.predict(x, verbose=0).shape == (N, CLASSES)
    assert inject_oom.calls == []
    assert int(model.optimizer.iterations) == 1 + N // BATCH


# --------------------------------------------------------------------------
# One sample does not fit
# --------------------------------------------------------------------------
class _FailFrom(keras.callbacks.Callback):
    """Sets the injector's threshold to 0 (nothing fits) from `batch` of epoch 0 on."""

    def __init__(self, injector, batch):
        super().__init__()
        self.injector, self.batch = injector, batch

    def on_train_batch_begin(self, batch, logs=None):
        if batch == self.batch:
            self.injector.threshold = 0


def test_single_sample_oom_raises_out_of_memory_error(inject_oom):
    x, y, _ = _data()
    model = _classifier()
    inject_oom(0)
    with pytest.raises(oom_error_class()) as info:
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[MemFit()])
    assert isinstance(info.value, OutOfMemoryError)
    assert info.value.phase == "train"
    assert 1 in inject_oom.ooms()  # a batch of one sample was tried


def test_single_sample_oom_leaves_state_as_before_the_step(inject_oom):
    x, y, _ = _data()
    model = _classifier(optimizer=lambda: keras.optimizers.SGD(0.1, momentum=0.9))
    keras_functions = _keras_functions(model)
    record = _Record()
    memfit = MemFit()
    inject_oom(None)
    with pytest.raises(OutOfMemoryError):
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False,
                  callbacks=[record, _FailFrom(inject_oom, 2), memfit])
    assert record.batch == 2 and record.iterations == 2
    assert int(model.optimizer.iterations) == record.iterations
    for i, (a, e) in enumerate(zip(model.get_weights(), record.weights)):
        np.testing.assert_array_equal(a, e, err_msg=f"weight {i}")
    for a, e in zip(_optimizer_values(model), record.optimizer):
        np.testing.assert_array_equal(a, e)
    for a, e in zip(model.metrics_variables, record.metrics):
        np.testing.assert_array_equal(np.array(a), e)
    _assert_keras_functions(model, keras_functions, memfit)


# --------------------------------------------------------------------------
# Reuse across fit calls; events and History
# --------------------------------------------------------------------------
def test_reused_instance_second_fit_pays_no_oom(inject_oom):
    x, y, _ = _data()
    reference = _classifier()
    inject_oom(None)
    reference.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    ref_history = reference.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                                validation_data=(x[:24], y[:24]))
    model = _classifier()
    memfit = MemFit()
    inject_oom(THRESHOLD)
    val = (x[:24], y[:24])
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              validation_data=val, callbacks=[memfit])
    assert inject_oom.ooms("train") and inject_oom.ooms("evaluate") and memfit.events
    inject_oom.calls.clear()
    history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                        validation_data=val, callbacks=[memfit])
    assert inject_oom.ooms() == [], "the second fit paid an OOM for a learned signature"
    assert not [e for e in memfit.events if e["kind"] == "oom"]
    assert history.history["memfit_ooms"] == [0]
    ok = inject_oom.rows("train")
    assert ok and max(ok) <= THRESHOLD  # still split: it remembers what failed
    _assert_same_training(reference, ref_history, model, history)


def test_reused_instance_events_reset_between_fits(inject_oom):
    x, y, _ = _data()
    memfit = MemFit()
    first = _classifier()
    inject_oom(THRESHOLD)
    first.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[memfit])
    assert memfit.events
    # A model that fits everything: the events of the first fit must be gone.
    second = _classifier()
    inject_oom(None)
    history = second.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, callbacks=[memfit])
    assert memfit.events == []
    assert not MEMFIT_KEYS & set(history.history)  # nothing adapted: Keras's logs only


def test_reused_instance_works_for_a_second_model(inject_oom):
    x, y, _ = _data()
    memfit = MemFit()
    other = _classifier()
    inject_oom(THRESHOLD)
    other.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False, callbacks=[memfit])
    assert inject_oom.ooms("train")
    inject_oom.calls.clear()
    pair = _fit_pair(_classifier, inject_oom, dict(x=x, y=y, batch_size=BATCH, epochs=1),
                     memfit=memfit)
    assert inject_oom.ooms("train"), "a new model must be planned afresh"
    assert memfit.events and all(e["epoch"] == 0 for e in memfit.events)
    _assert_same_training(*pair[:4])


class _CountPieces(keras.callbacks.Callback):
    """Successful train pieces per batch, from the injector's log."""

    def __init__(self, injector):
        super().__init__()
        self.injector = injector
        self.per_epoch = {}

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        self.per_epoch[epoch] = []

    def on_train_batch_begin(self, batch, logs=None):
        self.start = len(self.injector.calls)

    def on_train_batch_end(self, batch, logs=None):
        calls = self.injector.calls[self.start:]
        self.per_epoch[self.epoch].append(
            sum(1 for phase, _, raised in calls if phase == "train" and not raised))


def test_events_and_history_entries(inject_oom):
    x, y, _ = _data(n=64)  # 4 batches per epoch

    class ThresholdFrom(keras.callbacks.Callback):  # OOMs from epoch 1, step 2 on
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_begin(self, batch, logs=None):
            if (self.epoch, batch) == (1, 2):
                inject_oom.threshold = THRESHOLD

    model = _classifier()
    memfit = MemFit()
    pieces = _CountPieces(inject_oom)
    inject_oom(None)
    history = model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False,
                        callbacks=[ThresholdFrom(), pieces, memfit])
    required = {"epoch", "step", "phase", "kind", "old_split", "new_split"}
    assert memfit.events
    for event in memfit.events:
        assert required <= set(event), event
    first = memfit.events[0]
    assert list(first) == [field.name for field in dataclasses.fields(Event)]
    assert (first["epoch"], first["step"], first["phase"], first["kind"]) == (1, 2, "train", "oom")
    assert first["old_split"] == 1 and first["new_split"] >= 2
    assert first["batch_size"] == BATCH and first["old_size"] == BATCH
    ooms = [e for e in memfit.events if e["kind"] == "oom"]
    assert len(ooms) == len(inject_oom.ooms())
    assert history.history["memfit_ooms"] == [0, len(ooms)]
    assert history.history["memfit_split"] == [max(pieces.per_epoch[0]), max(pieces.per_epoch[1])]
    assert history.history["memfit_split"][0] == 1
    assert history.history["memfit_split"][1] >= math.ceil(BATCH / THRESHOLD)


# --------------------------------------------------------------------------
# evaluate and predict with MemFit
# --------------------------------------------------------------------------
def test_evaluate_with_memfit_equals_plain_small_batch_evaluate(inject_oom):
    x, y, _ = _data()
    model = _classifier()
    expected = model.evaluate(x, y, batch_size=4, verbose=0, return_dict=True)
    keras_functions = _keras_functions(model)
    memfit = MemFit()
    inject_oom(THRESHOLD)
    result = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True,
                            callbacks=[memfit])
    assert inject_oom.ooms("evaluate")
    assert memfit.events and {e["phase"] for e in memfit.events} == {"evaluate"}
    assert set(result) == set(expected)
    for key in expected:
        np.testing.assert_allclose(result[key], expected[key], rtol=RTOL, atol=ATOL, err_msg=key)
    _assert_keras_functions(model, keras_functions, memfit)


def test_predict_with_memfit_equals_plain_small_batch_predict(inject_oom):
    x, _, _ = _data()
    model = _classifier()
    expected = model.predict(x, batch_size=4, verbose=0)
    keras_functions = _keras_functions(model)
    memfit = MemFit()
    inject_oom(THRESHOLD)
    result = model.predict(x, batch_size=BATCH, verbose=0, callbacks=[memfit])
    assert inject_oom.ooms("predict")
    assert result.shape == expected.shape
    np.testing.assert_allclose(result, expected, rtol=RTOL, atol=ATOL)
    _assert_keras_functions(model, keras_functions, memfit)


# --------------------------------------------------------------------------
# The backend seam MemFit runs on
# --------------------------------------------------------------------------
def test_train_steps_satisfy_the_train_step_protocol():
    x, y, _ = _data(n=BATCH)
    default_model, custom_model = _classifier(), _classifier(model_class=CustomStepModel)
    for model in (default_model, custom_model):
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)  # builds the optimizer
    default = backend.make_train_step(default_model)
    custom = backend.make_custom_train_step(custom_model)
    assert isinstance(default, base.TrainStep) and isinstance(custom, base.TrainStep)
    # On JAX a model's own train_step is functional too: its step writes the
    # new state only once it succeeded, so it snapshots itself as well.
    assert default.snapshots_itself and custom.snapshots_itself is (BACKEND == "jax")
    assert default.last_outcome is None and custom.last_outcome is None
    assert isinstance(backend.make_accumulator(default_model), base.Accumulator)


@pytest.mark.parametrize("after, outcome", [
    (False, base.StepOutcome.UNTOUCHED),
    # TensorFlow's step updates variables as it runs; JAX's writes none before
    # it succeeded (tests/test_jax_real_oom.py: a real OOM leaves it untouched).
    pytest.param(True, base.StepOutcome.UPDATE_BEGAN, marks=requires_tensorflow),
], ids=["before", "after"])
def test_train_step_tells_how_far_a_failed_call_got(inject_oom, after, outcome):
    x, y, _ = _data(n=BATCH)
    model = _classifier()
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    step = backend.make_train_step(model)
    inject_oom(THRESHOLD, after=after)
    with pytest.raises(oom_error_class()):
        step((x, y))
    assert step.last_outcome is outcome


@requires_tensorflow
def test_step_function_has_the_tensorflow_calling_convention():
    from keras_memfit.backend import tensorflow as tf_backend

    model = _classifier(steps_per_execution=2)
    seen = []

    def run_batches(batches):
        seen.append(batches)
        return {"batches": len(batches)}

    train = tf_backend.step_function(model, "train", run_batches)
    iterator = iter(["a", "b", "c"])
    assert train(iterator) == {"batches": 2} and seen[-1] == ["a", "b"]
    assert train(iterator) == {"batches": 1} and seen[-1] == ["c"]
    with pytest.raises(StopIteration) as info:
        train(iterator)
    assert tf_backend.is_end_of_data(info.value)
    assert tf_backend.is_end_of_data(tf.errors.OutOfRangeError(None, None, "end of data"))
    assert not tf_backend.is_end_of_data(ValueError("not the end"))
    predict = tf_backend.step_function(model, "predict", run_batches)
    assert predict(iter([("x",)])) == {"batches": 1} and seen[-1] == [("x",)]
    with pytest.raises(ValueError, match=r"kind must be(.|\n)*received kind='fit'"):
        tf_backend.step_function(model, "fit", run_batches)


def test_untested_keras_version_warns_once(monkeypatch, caplog):
    from keras_memfit import _keras_compat

    monkeypatch.setattr(keras, "__version__", "3.99.0")
    monkeypatch.setattr(_keras_compat, "_warned_version", False)
    x, y, _ = _data(n=BATCH)
    model = _classifier()
    with caplog.at_level(logging.WARNING, logger="keras_memfit"):
        for _ in range(2):
            model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[MemFit()])
    warnings = [r for r in caplog.records if "outside that range" in r.getMessage()]
    assert len(warnings) == 1 and "3.99.0" in warnings[0].getMessage()
