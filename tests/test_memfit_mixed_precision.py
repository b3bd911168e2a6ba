"""MemFit(mode="accumulate") under mixed precision: the summed gradient goes through the LossScaleOptimizer's rule.

Keras wraps the optimizer of a `mixed_float16` model in a
`LossScaleOptimizer`, which skips an update whose gradient is not finite and
halves its loss scale, and doubles the scale after `dynamic_growth_steps`
finite ones. The reference is plain Keras at the same batch (every batch of
16 accumulated from micro-batches of at most 5 rows under MemFit,
`inject_oom`): with no overflow, the same updates and loss-scale trajectory
within float16's rounding; with a batch whose gradient overflows in float16
in one micro-batch, the whole batch skipped and the scale halved, as Keras
skips it.
"""

from __future__ import annotations

import logging

import keras
import numpy as np
import pytest

from memfit_support import BATCH, FEATURES, N, SEED, _fit_pair

# float16 activations: the micro-batches round otherwise than the batch (measured: 7e-6).
TOL = dict(rtol=1e-4, atol=2e-5)


@pytest.fixture
def mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


def _regressor(initial_scale=2**15):
    keras.utils.set_random_seed(SEED)
    model = keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dense(1),
    ])
    optimizer = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(learning_rate=0.01), initial_scale=initial_scale,
        dynamic_growth_steps=2)
    model.compile(optimizer=optimizer, loss="mse")
    return model


def _data(outlier=None):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, FEATURES)).astype("float32")
    y = rng.normal(size=(N, 1)).astype("float32")
    if outlier is not None:  # its gradient times the loss scale overflows float16
        y[outlier] = outlier_target = 3000.0
        assert outlier_target * 2 / BATCH * 2**15 > np.finfo("float16").max
    return x, y


def _loss_scale(model):
    optimizer = model.optimizer
    return [float(keras.ops.convert_to_numpy(v.value)) for v in (
        optimizer.dynamic_scale, optimizer.step_counter, optimizer.iterations)]


def _assert_same_loss_scaled_training(reference, ref_history, model, history):
    assert _loss_scale(model) == _loss_scale(reference)
    for a, e in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, e, **TOL)
    np.testing.assert_allclose(history.history["loss"], ref_history.history["loss"], **TOL)


@pytest.mark.usefixtures("mixed_float16")
def test_no_overflow_same_updates_and_loss_scale_as_plain_keras(inject_oom, caplog):
    x, y = _data()
    with caplog.at_level(logging.WARNING, logger="keras_memfit"):
        pair = _fit_pair(lambda: _regressor(initial_scale=16), inject_oom,
                         dict(x=x, y=y, batch_size=BATCH, epochs=2))
    assert inject_oom.ooms("train")
    reference, ref_history, model, history = pair[:4]
    assert _loss_scale(reference) == [128, 0, 6]  # no step skipped; doubled every 2 steps
    _assert_same_loss_scaled_training(reference, ref_history, model, history)
    warned = [r.getMessage() for r in caplog.records if "LossScaleOptimizer" in r.getMessage()]
    assert len(warned) == 1 and "float16 overflows depends on the batch size" in warned[0]


@pytest.mark.usefixtures("mixed_float16")
def test_an_overflowing_micro_batch_skips_the_batch_and_halves_the_scale(inject_oom):
    x, y = _data(outlier=20)  # in the second batch, in one of its micro-batches
    pair = _fit_pair(_regressor, inject_oom, dict(x=x, y=y, batch_size=BATCH, epochs=2))
    assert inject_oom.ooms("train")
    reference, ref_history, model, history = pair[:4]
    scale, _, iterations = _loss_scale(reference)
    assert iterations < 6 and scale < 2**15  # Keras skipped batches and halved the scale
    _assert_same_loss_scaled_training(reference, ref_history, model, history)
