"""MemFit says so when a split batch cannot equal the unsplit one: batch statistics and masks.

Accumulated micro-batches give the unsplit batch's update exactly, except
in layers whose training computation depends on the batch itself:
BatchNormalization (batch statistics, moving statistics updated per call)
and layers that draw random numbers (Dropout). The first time a batch of
such a model is accumulated, MemFit logs one WARNING naming those layers and
what `mode="shrink"` would do instead; nothing when nothing is split, and
nothing for a model without such layers, nor for an LSTM with `dropout=0`
(its cell holds a seed generator but draws nothing) or a frozen
BatchNormalization (it runs in inference mode). OOMs are injected (`inject_oom`).
"""

from __future__ import annotations

import logging

import keras
import numpy as np
import pytest

from keras_memfit import MemFit


def _model(middle):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, name="hidden"),
                              *middle, keras.layers.Dense(1, name="out")])
    model.compile(optimizer="sgd", loss="mse")
    return model


def _lstm(dropout):
    return [keras.layers.Reshape((4, 2)), keras.layers.LSTM(3, dropout=dropout, name="lstm")]


MODELS = {
    "batchnorm": lambda: _model([keras.layers.BatchNormalization(name="bn")]),
    "dropout": lambda: _model([keras.layers.Dropout(0.2, name="drop")]),
    "lstm_dropout": lambda: _model(_lstm(0.3)),
    "plain": lambda: _model([]),
    "lstm": lambda: _model(_lstm(0.0)),
    "frozen_batchnorm": lambda: _model([keras.layers.BatchNormalization(name="bn",
                                                                        trainable=False)]),
}
NAMES = {"batchnorm": "bn (BatchNormalization)", "dropout": "drop (Dropout)",
         "lstm_dropout": "(LSTMCell)"}


def _fit(model, caplog):
    rng = np.random.default_rng(0)
    x, y = rng.random((64, 6), dtype=np.float32), rng.random((64, 1), dtype=np.float32)
    with caplog.at_level(logging.WARNING, logger="keras_memfit"):
        model.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[MemFit()])
    return [r for r in caplog.records if "depend on how a batch is split" in r.getMessage()]


@pytest.mark.parametrize("kind", ["batchnorm", "dropout", "lstm_dropout"])
def test_one_warning_names_the_layers_when_a_batch_is_first_accumulated(inject_oom, caplog,
                                                                       kind):
    inject_oom(16, phases=("train",))
    warnings = _fit(MODELS[kind](), caplog)
    assert inject_oom.ooms(), "nothing was split: the test proves nothing"
    assert len(warnings) == 1, [r.getMessage() for r in warnings]  # once, not per batch
    message = warnings[0].getMessage()
    assert warnings[0].levelno == logging.WARNING
    assert NAMES[kind] in message and 'mode="shrink"' in message
    assert "hidden" not in message and "out (" not in message  # only those layers


@pytest.mark.parametrize("kind", ["batchnorm", "dropout"])
def test_no_warning_when_nothing_is_split(inject_oom, caplog, kind):
    inject_oom(None)
    assert _fit(MODELS[kind](), caplog) == []


@pytest.mark.parametrize("kind", ["plain", "lstm", "frozen_batchnorm"])
def test_no_warning_for_a_model_without_such_layers(inject_oom, caplog, kind):
    inject_oom(16, phases=("train",))
    assert _fit(MODELS[kind](), caplog) == []
    assert inject_oom.ooms()
