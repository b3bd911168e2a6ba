"""`place` without an accelerator says so once per process, not once per call (issue 12, item 8)."""

from __future__ import annotations

import logging

import keras

from keras_memfit import placement


def _model():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="d")])
    return model


def test_without_accelerator_place_logs_once_per_process_at_info(monkeypatch, caplog):
    from keras_memfit.backend import tensorflow as tf_backend

    monkeypatch.setattr(tf_backend, "list_accelerators", list)
    monkeypatch.setattr(placement, "_said_no_accelerator", False)
    with caplog.at_level(logging.INFO, logger="keras_memfit"):
        for _ in range(3):
            plan = placement.place(_model(), budget=1000)
            assert not plan.applied
    shown = [r for r in caplog.records if r.levelno >= logging.INFO]
    assert len(shown) == 1, [r.getMessage() for r in shown]
    assert "no GPU" in shown[0].getMessage()
