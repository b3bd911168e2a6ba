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

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_memfit import MemFit, OutOfMemoryError
from keras_memfit.backend import base
from keras_memfit.planning.planner import Event
from memfit_support import (
    _assert_keras_functions,
    _assert_same_training,
    ATOL,
    BATCH,
    CLASSES,
    _classifier,
    _data,
    _fit_pair,
    _keras_functions,
    MEMFIT_KEYS,
    N,
    _optimizer_values,
    _Record,
    RTOL,
    THRESHOLD,
)
from support import (
    BACKEND,
    CustomStepModel,
    backend_module,
    oom_error_class,
    requires_tensorflow,
    runtime_error,
)

backend = backend_module()


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
    add = backend.training.GradientAccumulator.add

    def failing_add(self, data, weight, loss_factor):
        raise runtime_error("not an OOM")

    monkeypatch.setattr(backend.training.GradientAccumulator, "add", failing_add)
    inject_oom(THRESHOLD)
    with pytest.raises(type(runtime_error(""))):
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[memfit])
    monkeypatch.setattr(backend.training.GradientAccumulator, "add", add)
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
    add = backend.training.GradientAccumulator.add  # the injector's
    calls = []

    def add_then_fail(self, data, weight, loss_factor):
        calls.append(weight)
        if len(calls) == 2:  # the first micro-batch after the 8-row one ran out
            raise error
        add(self, data, weight, loss_factor)

    monkeypatch.setattr(backend.training.GradientAccumulator, "add", add_then_fail)
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
    add = backend.training.GradientAccumulator.add  # the injector's
    per_step = {}

    def add_then_interrupt(self, data, weight, loss_factor):
        key = (record.epoch, record.batch)
        per_step[key] = per_step.get(key, 0) + 1
        if key == (0, 1) and per_step[key] == 3:  # step 1, after two micro-batches ran
            raise KeyboardInterrupt
        add(self, data, weight, loss_factor)

    monkeypatch.setattr(backend.training.GradientAccumulator, "add", add_then_interrupt)
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
    monkeypatch.setattr(backend.training.GradientAccumulator, "add", add)
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
    custom = backend.make_custom_train_step(custom_model, (x, y))
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
def test_keras_call_has_the_tensorflow_calling_convention():
    from keras_memfit.backend import tensorflow as tf_backend

    model = _classifier(steps_per_execution=2)
    seen, pulled = [], []

    def run_batches(batches):
        ran = [(batch, list(pulled)) for batch in batches]  # what was pulled when it ran
        seen.append(ran)
        return {"batches": len(ran)}

    def pulling(items):
        for item in items:
            pulled.append(item)
            yield item

    def train(iterator):
        with tf_backend.keras_call(model, "train", iterator) as call:
            return call.returned(run_batches(call.batches))

    iterator = pulling(["a", "b", "c"])
    # Each batch pulled once the one before ran, as Keras's multi-step function pulls them.
    assert train(iterator) == {"batches": 2}
    assert seen[-1] == [("a", ["a"]), ("b", ["a", "b"])]
    assert train(iterator) == {"batches": 1} and seen[-1] == [("c", ["a", "b", "c"])]
    with pytest.raises(StopIteration) as info:
        train(iterator)
    assert tf_backend.is_end_of_data(info.value)
    assert tf_backend.is_end_of_data(tf.errors.OutOfRangeError(None, None, "end of data"))
    assert not tf_backend.is_end_of_data(ValueError("not the end"))
    with tf_backend.keras_call(model, "predict", iter([("x",)])) as call:
        assert call.returned(run_batches(call.batches)) == {"batches": 1}
    assert seen[-1][0][0] == ("x",)
    with pytest.raises(ValueError, match=r"kind must be(.|\n)*received kind='fit'"):
        tf_backend.keras_call(model, "fit", iter([]))


def test_untested_keras_version_warns_once(monkeypatch, caplog):
    from keras_memfit._internal import keras_compat as _keras_compat

    monkeypatch.setattr(keras, "__version__", "3.99.0")
    monkeypatch.setattr(_keras_compat, "_warned_version", False)
    x, y, _ = _data(n=BATCH)
    model = _classifier()
    with caplog.at_level(logging.WARNING, logger="keras_memfit"):
        for _ in range(2):
            model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[MemFit()])
    warnings = [r for r in caplog.records if "outside that range" in r.getMessage()]
    assert len(warnings) == 1 and "3.99.0" in warnings[0].getMessage()
