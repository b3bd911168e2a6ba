"""Models with stateful layers run at Keras's own batches only (issue 47, item 3).

A layer built with `stateful=True` (a stateful LSTM) carries its state from
one batch to the next at the batch size the model was built for, so
keras_memfit never runs such a model at another size: with no memory
pressure every call equals plain Keras's (bitwise), and a batch that runs
out of memory is refused with `OutOfMemoryError` cause "cannot_split",
naming the stateful layer. The reference is always plain Keras.
"""

from __future__ import annotations

import pickle

import keras
import numpy as np
import pytest

from keras_memfit import MemFit, OutOfMemoryError, safe_evaluate, safe_predict
from support import backend_module, keras_trains_stateful_rnns, oom_error, oom_error_class

# At least the planner's MIN_PROBE_REQUEST: where memory statistics exist it
# would probe a batch this large with 16 and 64 rows.
BATCH = 128
STEPS, FEATURES = 5, 3
SEED = 3


def _model():
    keras.utils.set_random_seed(SEED)
    inputs = keras.Input(batch_shape=(BATCH, STEPS, FEATURES))
    hidden = keras.layers.LSTM(4, stateful=True, name="memory")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2)(hidden), name="stateful_net")
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    return model


def _data(batches, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batches * BATCH, STEPS, FEATURES)).astype("float32")
    return x, rng.normal(size=(batches * BATCH, 2)).astype("float32")


def _run(callbacks):
    """fit (with validation), evaluate and predict, in that order, on a fresh model."""
    x, y = _data(3)
    x_val, y_val = _data(2, seed=1)
    model = _model()
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                        validation_data=(x_val, y_val), callbacks=callbacks)
    evaluated = model.evaluate(x_val, y_val, batch_size=BATCH, verbose=0, callbacks=callbacks)
    predicted = model.predict(x, batch_size=BATCH, verbose=0, callbacks=callbacks)
    return history.history, evaluated, predicted, model.get_weights()


def _assert_equal_arrays(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


@keras_trains_stateful_rnns
def test_fit_evaluate_and_predict_with_memfit_are_plain_keras_s_bitwise():
    history, evaluated, predicted, weights = _run([MemFit()])
    want_history, want_evaluated, want_predicted, want_weights = _run([])
    assert history == want_history
    assert evaluated == want_evaluated
    np.testing.assert_array_equal(predicted, want_predicted)
    _assert_equal_arrays(weights, want_weights)


@pytest.fixture
def memory_statistics(monkeypatch):
    """The backend reports memory statistics, so the planner would probe a new batch."""
    backend = backend_module()
    monkeypatch.setattr(backend, "memory_stats", lambda device: (1 << 20, 1 << 20))
    monkeypatch.setattr(backend, "reset_peak", lambda device: None)


def test_safe_evaluate_and_safe_predict_are_keras_s_with_no_probe(memory_statistics):
    x, y = _data(3)
    model, reference = _model(), _model()
    # Fresh models: safe_evaluate builds the metrics on Keras's first batch.
    got = safe_evaluate(model, x, y, batch_size=BATCH, verbose=0)
    assert got == reference.evaluate(x, y, batch_size=BATCH, verbose=0)
    predicted = safe_predict(model, x, batch_size=BATCH, verbose=0)
    np.testing.assert_array_equal(predicted, reference.predict(x, batch_size=BATCH, verbose=0))


def _assert_refused(err, phase):
    assert isinstance(err, OutOfMemoryError)
    assert err.cause == "cannot_split" and err.phase == phase
    assert err.stateful == ("memory",)
    message = str(err)
    assert message.startswith(f"Model 'stateful_net' ran out of memory in {phase}")
    assert "stateful layers ('memory'), whose batches MemFit never splits" in message
    assert "batch_shape" in message  # the advice: build the model for a smaller batch


@pytest.mark.parametrize("phase", ["predict", "evaluate"])
def test_safe_predict_and_safe_evaluate_refuse_to_split_a_stateful_batch(phase, inject_oom):
    x, y = _data(2)
    inject_oom(BATCH - 1)
    with pytest.raises(oom_error_class()) as info:
        if phase == "predict":
            safe_predict(_model(), x, batch_size=BATCH, verbose=0)
        else:
            safe_evaluate(_model(), x, y, batch_size=BATCH, verbose=0)
    _assert_refused(info.value, phase)
    assert f"on a batch of {BATCH} rows" in str(info.value)
    assert inject_oom.rows(phase) == [BATCH]  # tried once, whole: no probe, no smaller piece


@keras_trains_stateful_rnns
def test_fit_with_memfit_refuses_to_split_a_stateful_batch():
    x, y = _data(2)
    model = _model()
    calls = []

    def out_of_memory(*args, **kwargs):  # Keras's own train step runs out of memory
        calls.append(args)
        raise oom_error(BATCH)

    model.train_function = out_of_memory
    with pytest.raises(oom_error_class()) as info:
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[MemFit()])
    _assert_refused(info.value, "train")
    assert len(calls) == 1


def test_the_refusal_round_trips_with_its_stateful_layers():
    err = OutOfMemoryError("net", "predict", cause="cannot_split", rows=8, stateful=("a", "b"))
    back = pickle.loads(pickle.dumps(err))
    assert back.stateful == ("a", "b") and str(back) == str(err)
