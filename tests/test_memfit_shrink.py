"""MemFit after an OOM in validation or after the full step ran, mode="shrink", and MemFit's argument checks."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest

from keras_memfit import MemFit, OutOfMemoryError
from memfit_support import (
    _assert_same_training,
    ATOL,
    BATCH,
    _classifier,
    _data,
    _fit_pair,
    N,
    RTOL,
    THRESHOLD,
)
from support import (
    CustomStepModel,
    backend_module,
    requires_tensorflow,
)

backend = backend_module()


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


def test_invalid_mode():
    with pytest.raises(ValueError, match="mode"):
        MemFit(mode="bogus")


@pytest.mark.parametrize("place", ["yes", {"budjet": 1}, ["emb"], 3])
def test_invalid_place_names_what_was_received(place):
    with pytest.raises(ValueError, match=r"place must be(.|\n)*received place=" + re.escape(repr(place))):
        MemFit(place=place)
