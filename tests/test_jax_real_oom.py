"""Real out-of-memory errors under JAX: the model survives and results equal the reference.

Each test runs in a child process with Keras on JAX and an address-space
limit set before jax starts (`tests/jax_support.py`), so over-large batches
fail with a genuine `RESOURCE_EXHAUSTED` from XLA's CPU allocator. The
references are plain Keras at a batch that fits, and (for MemFit) the same
fit run without the limit.
"""

from __future__ import annotations

import json
import logging
import os

import numpy as np

from tests.jax_support import (
    REAL_OOM_FITS,
    REAL_OOM_LIMIT_GB,
    REAL_OOM_ROWS,
    hide_address_space_limit,
    real_oom_model,
    requires_jax,
    run_in_jax,
)

pytestmark = requires_jax

LIMIT_GB = REAL_OOM_LIMIT_GB  # see tests/jax_support.py for the scenario's sizes
ROWS = REAL_OOM_ROWS
FITS = REAL_OOM_FITS
_model = real_oom_model


def _data(rows=ROWS):
    rng = np.random.default_rng(0)
    return rng.random((rows, 8), dtype=np.float32), rng.integers(0, 3, rows)


class _OOMLog(logging.Handler):
    """Counts the planner's "out of memory" warnings."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.ooms = 0
        logging.getLogger("keras_memfit").addHandler(self)

    def emit(self, record):
        self.ooms += "out of memory" in record.getMessage()


def _same_weights(before, model):
    after = model.get_weights()  # readable: the state was not donated
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)


def _assert_keras_ooms(model, call):
    """`call()` (plain Keras at the full batch) runs out of memory: it raises a
    real JAX OOM, or returns and the model's donated state is gone (the trap
    keras_memfit avoids: `get_weights()` raises)."""
    import jax

    from keras_memfit import is_oom_error

    try:
        call()
        model.get_weights()
    except jax.errors.JaxRuntimeError as err:
        assert is_oom_error(err), str(err)[:300]
        return str(err)
    raise AssertionError("plain Keras did not run out of memory: the limit is too high")


# ------------------------------------------------------------------ children
def child_predict():
    import keras_memfit
    hide_address_space_limit()

    model = _model()
    x, _ = _data()
    expected = model.predict(x, batch_size=FITS, verbose=0)
    weights = model.get_weights()
    log = _OOMLog()
    result = keras_memfit.safe_predict(model, x, batch_size=ROWS, verbose=0)
    assert log.ooms >= 1, "safe_predict met no OOM: the test proves nothing"
    np.testing.assert_allclose(result, expected, rtol=1e-5, atol=1e-6)
    _same_weights(weights, model)
    again = keras_memfit.safe_predict(model, x[:FITS], batch_size=FITS, verbose=0)
    np.testing.assert_allclose(again, expected[:FITS], rtol=1e-5, atol=1e-6)
    message = _assert_keras_ooms(model, lambda: model.predict(x, batch_size=ROWS, verbose=0))
    print("KERAS_OOM", message[:120])


def child_evaluate():
    import keras_memfit
    hide_address_space_limit()

    model = _model()
    x, y = _data()
    expected = model.evaluate(x, y, batch_size=FITS, verbose=0, return_dict=True)
    weights = model.get_weights()
    log = _OOMLog()
    result = keras_memfit.safe_evaluate(model, x, y, batch_size=ROWS, verbose=0, return_dict=True)
    assert log.ooms >= 1, "safe_evaluate met no OOM: the test proves nothing"
    assert set(result) == set(expected)
    for name in expected:
        np.testing.assert_allclose(result[name], expected[name], rtol=1e-5)
    _same_weights(weights, model)
    _assert_keras_ooms(
        model, lambda: model.evaluate(x, y, batch_size=ROWS, verbose=0, return_dict=True)
    )


def _state(model):
    """Every variable of the model and its optimizer, read (readable: not donated)."""
    return [np.array(v.value) for v in model.variables + list(model.optimizer.variables)]


def _assert_same_state(before, model):
    after = _state(model)
    assert len(after) == len(before)
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)


def child_train_step_and_accumulator_oom_leave_the_model():
    """A real OOM in keras_memfit's own train step and in an accumulated
    micro-batch: weights, optimizer variables, iterations and metrics are
    readable and exactly as before; the next, smaller step trains as plain
    Keras's does."""
    import jax

    from keras_memfit import backend, is_oom_error
    from keras_memfit.backend.base import StepOutcome

    jax_backend = backend.get()
    model, reference = _model(), _model()
    x, y = _data()
    model.fit(x[:FITS], y[:FITS], batch_size=FITS, epochs=1, shuffle=False, verbose=0)
    reference.fit(x[:FITS], y[:FITS], batch_size=FITS, epochs=1, shuffle=False, verbose=0)
    before = _state(model)
    step = jax_backend.make_train_step(model)
    try:
        step((x, y))
    except jax.errors.JaxRuntimeError as err:
        assert is_oom_error(err), str(err)[:300]
    else:
        raise AssertionError("the full batch trained under the limit: the test proves nothing")
    assert step.last_outcome is StepOutcome.UNTOUCHED
    _assert_same_state(before, model)
    accumulator = jax_backend.make_accumulator(model)
    accumulator.reset()
    try:
        accumulator.add((x, y, None), 1.0, 1.0)
    except jax.errors.JaxRuntimeError as err:
        assert is_oom_error(err), str(err)[:300]
    else:
        raise AssertionError("the full micro-batch ran under the limit: the test proves nothing")
    _assert_same_state(before, model)
    # The model trains on from where it was, as plain Keras's copy does.
    step((x[FITS:2 * FITS], y[FITS:2 * FITS]))
    reference.fit(x[FITS:2 * FITS], y[FITS:2 * FITS], batch_size=FITS, epochs=1,
                  shuffle=False, verbose=0)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert int(model.optimizer.iterations.value) == int(reference.optimizer.iterations.value) == 2


def child_fit():
    """Fits with MemFit; writes weights, optimizer variables and History to $OUT."""
    import keras_memfit
    hide_address_space_limit()

    model = _model()
    x, y = _data(ROWS // 2)
    log = _OOMLog()
    memfit = keras_memfit.MemFit()
    history = model.fit(
        x, y, batch_size=ROWS // 2, epochs=2, shuffle=False, verbose=0, callbacks=[memfit]
    )
    out = os.environ["KERAS_MEMFIT_JAX_OUT"]
    np.savez(
        out + ".npz",
        *model.get_weights(),
        *[np.asarray(v.value) for v in model.optimizer.variables],
    )
    with open(out + ".json", "w") as f:
        json.dump({
            "history": {k: v for k, v in history.history.items() if not k.startswith("memfit")},
            "iterations": int(model.optimizer.iterations.value),
            "ooms": log.ooms,
            # Only a fit that adapted something logs memfit_split (issue 12).
            "split": history.history.get("memfit_split"),
        }, f)


# --------------------------------------------------------------------- tests
def test_safe_predict_under_a_real_oom_equals_keras_at_a_batch_that_fits():
    output = run_in_jax(__file__, "child_predict", address_space_gb=LIMIT_GB)
    assert "KERAS_OOM" in output


def test_safe_evaluate_under_a_real_oom_equals_keras_at_a_batch_that_fits():
    run_in_jax(__file__, "child_evaluate", address_space_gb=LIMIT_GB)


def test_memfit_fit_under_a_real_oom_equals_the_unlimited_fit(tmp_path):
    free, limited = str(tmp_path / "free"), str(tmp_path / "limited")
    run_in_jax(__file__, "child_fit", env={"KERAS_MEMFIT_JAX_OUT": free})
    run_in_jax(
        __file__, "child_fit", address_space_gb=LIMIT_GB,
        env={"KERAS_MEMFIT_JAX_OUT": limited},
    )
    with open(free + ".json") as f:
        reference = json.load(f)
    with open(limited + ".json") as f:
        result = json.load(f)
    assert reference["ooms"] == 0 and reference["split"] is None
    assert result["ooms"] >= 1 and max(result["split"]) > 1, result
    assert result["iterations"] == reference["iterations"] == 2
    assert set(result["history"]) == set(reference["history"])
    for name, values in reference["history"].items():
        np.testing.assert_allclose(result["history"][name], values, rtol=1e-4)
    expected, got = np.load(free + ".npz"), np.load(limited + ".npz")
    assert expected.files == got.files
    for key in expected.files:
        np.testing.assert_allclose(got[key], expected[key], rtol=1e-4, atol=1e-6)


def test_an_oom_in_a_train_step_or_micro_batch_leaves_the_model_as_it_was():
    run_in_jax(__file__, "child_train_step_and_accumulator_oom_leave_the_model",
               address_space_gb=LIMIT_GB)
