"""MemFit(mode="accumulate") with every loss reduction: the update plain Keras makes at the same batch.

The reference is plain Keras's fit at the same batch size, with nothing
split (`memfit_support._fit_pair`); the MemFit run has every batch of 16
accumulated as micro-batches of at most 5 rows (`inject_oom`). Where the
reductions of a model's losses cannot share one weight per micro-batch,
MemFit trains as mode="shrink" and its warning says why; the reference is
then plain Keras at the pieces' batch size.
"""

from __future__ import annotations

import logging

import keras
import numpy as np
import pytest

from keras_memfit import MemFit
from memfit_support import (
    BATCH,
    CLASSES,
    FEATURES,
    N,
    SEED,
    _assert_same_training,
    _classifier,
    _data,
    _fit_pair,
)
from support import requires_tensorflow


def _sgd():
    return keras.optimizers.SGD(learning_rate=0.01)


def _crossentropy(reduction):
    return lambda: _classifier(  # noqa: E731
        optimizer=_sgd, loss=keras.losses.SparseCategoricalCrossentropy(reduction=reduction))


@pytest.mark.parametrize("reduction", ["sum", "mean", "mean_with_sample_weight"])
def test_each_reduction_accumulates_as_plain_keras_at_the_same_batch(inject_oom, reduction):
    x, y, _ = _data()
    pair = _fit_pair(_crossentropy(reduction), inject_oom,
                     dict(x=x, y=y, batch_size=BATCH, epochs=2))
    assert inject_oom.ooms("train")
    _assert_same_training(*pair[:4])
    assert int(pair[2].optimizer.iterations) == 6  # one update per batch


@pytest.mark.parametrize("weights", ["sample_weight", "class_weight"])
def test_mean_with_sample_weight_weighs_micro_batches_by_their_sample_weights(
        inject_oom, weights):
    x, y, w = _data()
    given = {"sample_weight": w} if weights == "sample_weight" else {
        "class_weight": {0: 1.0, 1: 4.0, 2: 0.25}}
    build = lambda: _classifier(  # noqa: E731
        optimizer=_sgd, weighted_metrics=["accuracy"],
        loss=keras.losses.SparseCategoricalCrossentropy(reduction="mean_with_sample_weight"))
    pair = _fit_pair(build, inject_oom,
                     dict(x=x, y=y, batch_size=BATCH, epochs=2, **given))
    assert inject_oom.ooms("train")
    _assert_same_training(*pair[:4])


def test_sum_with_sample_weight(inject_oom):
    x, y, w = _data()
    pair = _fit_pair(_crossentropy("sum"), inject_oom,
                     dict(x=x, y=y, sample_weight=w, batch_size=BATCH, epochs=2))
    assert inject_oom.ooms("train")
    _assert_same_training(*pair[:4])


def _two_outputs(reductions, loss_weights=None, regularizer=None):
    def build():
        keras.utils.set_random_seed(SEED)
        inputs = keras.Input((FEATURES,))
        hidden = keras.layers.Dense(8, activation="relu", kernel_regularizer=regularizer)(inputs)
        reg = keras.layers.Dense(1, name="reg")(hidden)
        cls = keras.layers.Dense(CLASSES, activation="softmax", name="cls")(hidden)
        model = keras.Model(inputs, {"reg": reg, "cls": cls})
        model.compile(
            optimizer=_sgd(),
            loss={"reg": keras.losses.MeanSquaredError(reduction=reductions[0]),
                  "cls": keras.losses.SparseCategoricalCrossentropy(reduction=reductions[1])},
            loss_weights=loss_weights,
        )
        return model

    return build


def _two_output_data():
    x, y_cls, _ = _data()
    y_reg = np.random.default_rng(2).normal(size=(N, 1)).astype("float32")
    return x, {"reg": y_reg, "cls": y_cls}


def test_outputs_reduced_with_sum_and_loss_weights_accumulate_exactly(inject_oom):
    x, y = _two_output_data()
    build = _two_outputs(("sum", "sum"), loss_weights={"reg": 0.25, "cls": 2.0})
    pair = _fit_pair(build, inject_oom, dict(x=x, y=y, batch_size=BATCH, epochs=2))
    assert inject_oom.ooms("train")
    # Not "reg_loss" and "cls_loss": Keras's per-output trackers, updated inside
    # its compiled loss, record each micro-batch's sum as a mean (docs/training.md).
    _assert_same_training(*pair[:4], keys=["loss"])


@pytest.mark.parametrize("reductions, regularizer, why", [
    (("sum", "sum_over_batch_size"), None, "weigh a micro-batch differently"),
    (("mean_with_sample_weight", "mean_with_sample_weight"), None, "its own output's"),
    (("sum", "sum"), "l2", "regularizers, which count once per batch"),
])
def test_losses_one_weight_cannot_serve_train_as_shrink_saying_why(
        inject_oom, caplog, reductions, regularizer, why):
    x, y = _two_output_data()
    build = _two_outputs(reductions, regularizer=regularizer)
    reference = build()
    ref_history = reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    model = build()
    inject_oom(8)
    with caplog.at_level(logging.WARNING, logger="keras_memfit"):
        history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                            callbacks=[MemFit()])
    assert inject_oom.ooms("train")
    _assert_same_training(reference, ref_history, model, history, keys=["loss"])
    fallback = [r.getMessage() for r in caplog.records if "mode='shrink'" in r.getMessage()]
    assert len(fallback) == 1 and why in fallback[0], fallback


@requires_tensorflow(reason="a loss left unreduced (None): JAX and torch need a scalar loss")
def test_unreduced_loss_accumulates_as_its_sum(inject_oom):
    # Keras's TensorFlow step differentiates the unreduced values, so their sum.
    # Not History's "loss": Keras's tracker counts an unreduced batch's values
    # times its rows (rows squared), which micro-batches cannot add up to.
    x, y, _ = _data()
    pair = _fit_pair(_crossentropy(None), inject_oom,
                     dict(x=x, y=y, batch_size=BATCH, epochs=2))
    assert inject_oom.ooms("train")
    _assert_same_training(*pair[:4], keys=[])
