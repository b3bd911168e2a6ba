"""Real out-of-memory errors under torch: results equal the reference, the model survives.

Each test runs in a child process with Keras on torch and an address-space
limit set before its Python starts (`tests/torch_support.py`), so over-large
batches fail with PyTorch's genuine `DefaultCPUAllocator: can't allocate
memory`, or a kernel's `posix_memalign failed:Cannot allocate memory (12)`
(raised inside a layer, re-raised by Keras with the layer's call
prepended). The references are plain Keras at a batch that fits, and (for
MemFit) the same fit run in a child without the limit. The predict,
evaluate and fit children hide the limit from keras_memfit
(`hide_address_space_limit`), which would otherwise size the pieces from it
and might meet no OOM (that path: tests/test_torch_few_ooms.py).
"""

from __future__ import annotations

import gc
import json
import logging
import os

import numpy as np

from tests.torch_support import (
    FITS,
    REAL_OOM_HEADROOM_GB,
    assert_same_state,
    digits,
    hide_address_space_limit,
    requires_torch,
    run_in_torch,
    seed_cnn,
    state,
)

pytestmark = requires_torch

# The seed CNN's activations at these rows exceed the headroom (predict: about
# 2.8 GB at 12,000; training: about 3 GB at 4,096); FITS rows fit.
PREDICT_ROWS = 12000
TRAIN_ROWS = 4096


class _OOMLog(logging.Handler):
    """Counts the planner's "out of memory" warnings."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.ooms = 0
        logging.getLogger("keras_memfit").addHandler(self)

    def emit(self, record):
        self.ooms += "out of memory" in record.getMessage()


def _assert_ooms(call):
    """`call()` raises an error keras_memfit counts as an OOM; returns its message."""
    from keras_memfit import is_oom_error

    try:
        call()
    except RuntimeError as err:
        assert is_oom_error(err), str(err)[:300]
        return str(err)
    raise AssertionError("plain Keras did not run out of memory: the limit is too high")


# ------------------------------------------------------------------ children
def child_predict():
    import keras_memfit

    hide_address_space_limit()
    model = seed_cnn()
    x, _ = digits(PREDICT_ROWS)
    expected = model.predict(x, batch_size=FITS, verbose=0)
    weights = model.get_weights()
    message = _assert_ooms(lambda: model.predict(x, batch_size=PREDICT_ROWS, verbose=0))
    # A host allocation failed: PyTorch's CPU allocator, or a kernel's aligned
    # buffer (which of the two runs out first depends on the address space's
    # layout; CI has seen both).
    from keras_memfit.backend.torch.oom import is_aligned_alloc_oom, is_cpu_allocator_oom

    error = RuntimeError(message)
    assert is_cpu_allocator_oom(error) or is_aligned_alloc_oom(error), message[:300]
    log = _OOMLog()
    result = keras_memfit.safe_predict(model, x, batch_size=PREDICT_ROWS, verbose=0)
    assert log.ooms >= 1, "safe_predict met no OOM: the test proves nothing"
    np.testing.assert_allclose(result, expected, rtol=1e-5, atol=1e-6)
    for a, b in zip(weights, model.get_weights()):
        np.testing.assert_array_equal(a, b)
    print("OOMS", log.ooms)


def child_evaluate():
    import keras_memfit

    hide_address_space_limit()
    model = seed_cnn()
    x, y = digits(PREDICT_ROWS)
    expected = model.evaluate(x, y, batch_size=FITS, verbose=0, return_dict=True)
    before = state(model)
    _assert_ooms(lambda: model.evaluate(x, y, batch_size=PREDICT_ROWS, verbose=0))
    log = _OOMLog()
    result = keras_memfit.safe_evaluate(
        model, x, y, batch_size=PREDICT_ROWS, verbose=0, return_dict=True
    )
    assert log.ooms >= 1, "safe_evaluate met no OOM: the test proves nothing"
    assert set(result) == set(expected)
    for name in expected:
        np.testing.assert_allclose(result[name], expected[name], rtol=1e-5, err_msg=name)
    # Everything but the metrics (which evaluate itself sets) as before.
    after = state(model)
    n = len(model.variables) + len(model.optimizer.variables)
    for a, b in zip(before[:n], after[:n]):
        np.testing.assert_array_equal(a, b)


def child_train_step_and_accumulator_oom_leave_the_model():
    """A real OOM in keras_memfit's train step and in an accumulated micro-batch:
    weights, optimizer variables, iterations and metrics (the loss tracker was
    updated before the backward pass ran out) exactly as before; the next,
    smaller step trains as plain Keras's does."""
    from keras_memfit import backend, is_oom_error
    from keras_memfit.backend.base import StepOutcome

    torch_backend = backend.get()
    model, reference = seed_cnn(), seed_cnn()
    x, y = digits(TRAIN_ROWS)
    for m in (model, reference):
        m.fit(x[:FITS], y[:FITS], batch_size=FITS, epochs=1, shuffle=False, verbose=0)
    before = state(model)
    step = torch_backend.make_train_step(model)
    try:
        step((x, y))
    except RuntimeError as err:
        assert is_oom_error(err), str(err)[:300]
    else:
        raise AssertionError("the full batch trained under the limit: the test proves nothing")
    gc.collect()  # as keras_memfit's retry loop does: the traceback's cycles hold the step's tensors
    assert step.last_outcome is StepOutcome.RESTORED
    assert_same_state(before, model)
    assert all(w.value.grad is None for w in model.trainable_weights)
    accumulator = torch_backend.make_accumulator(model)
    guard = torch_backend.guard_variables(
        __import__("keras_memfit._internal.model_state", fromlist=["x"]).train_state_variables(model)
    )
    accumulator.reset()
    guard.snapshot()
    try:
        accumulator.add((x, y, None), 1.0, 1.0)
    except RuntimeError as err:
        assert is_oom_error(err), str(err)[:300]
        guard.restore()
    else:
        raise AssertionError("the full micro-batch ran under the limit: the test proves nothing")
    gc.collect()
    assert_same_state(before, model)
    # The model trains on from where it was, as plain Keras's copy does.
    part = slice(FITS, 2 * FITS)
    step((x[part], y[part]))
    reference.fit(x[part], y[part], batch_size=FITS, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert int(model.optimizer.iterations.numpy()) == int(
        reference.optimizer.iterations.numpy()) == 2


def child_fit():
    """Fits with MemFit (plain Keras without $MEMFIT=1); writes the result to $OUT."""
    import keras_memfit

    import keras

    hide_address_space_limit()
    model = seed_cnn()
    # SGD with momentum (a slot per weight): Adam's division by sqrt(v) turns
    # the rounding of gradients that cancel to nearly zero (a channel of random
    # digits) into differences of up to 40% of a step, which says nothing about
    # the accumulation; tests/test_torch_memfit.py checks Adam where they do not.
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    x, y = digits(TRAIN_ROWS)
    sample_weight = np.linspace(0.5, 1.5, TRAIN_ROWS).astype("float32")
    log = _OOMLog()
    callbacks = [keras_memfit.MemFit()] if os.environ.get("MEMFIT") == "1" else []
    history = model.fit(
        x, y, sample_weight=sample_weight, batch_size=TRAIN_ROWS // 2, epochs=2,
        shuffle=False, verbose=0, callbacks=callbacks,
    )
    out = os.environ["KERAS_MEMFIT_TORCH_OUT"]
    np.savez(out + ".npz", *model.get_weights(), *[v.numpy() for v in model.optimizer.variables])
    with open(out + ".json", "w") as f:
        json.dump({
            "history": {k: v for k, v in history.history.items() if not k.startswith("memfit")},
            "iterations": int(model.optimizer.iterations.numpy()),
            "ooms": log.ooms,
            "split": history.history.get("memfit_split"),
        }, f)


# --------------------------------------------------------------------- tests
def test_safe_predict_under_a_real_oom_equals_keras_at_a_batch_that_fits():
    output = run_in_torch(__file__, "child_predict", headroom_gb=REAL_OOM_HEADROOM_GB)
    assert "OOMS" in output


def test_safe_evaluate_under_a_real_oom_equals_keras_at_a_batch_that_fits():
    run_in_torch(__file__, "child_evaluate", headroom_gb=REAL_OOM_HEADROOM_GB)


def test_a_real_oom_in_the_train_step_or_a_micro_batch_leaves_the_model_and_metrics():
    run_in_torch(__file__, "child_train_step_and_accumulator_oom_leave_the_model",
                 headroom_gb=REAL_OOM_HEADROOM_GB)


def _fit(tmp_path, name, memfit, headroom_gb):
    out = str(tmp_path / name)
    env = {"KERAS_MEMFIT_TORCH_OUT": out, "MEMFIT": "1" if memfit else "0"}
    run_in_torch(__file__, "child_fit", headroom_gb=headroom_gb, env=env)
    with open(out + ".json") as f:
        info = json.load(f)
    with np.load(out + ".npz") as arrays:
        return info, [arrays[k] for k in arrays.files]


def test_memfit_under_a_real_oom_trains_as_the_unlimited_fit(tmp_path):
    """Batches that run out of memory are accumulated: same weights, optimizer
    variables, iterations and History as plain Keras's fit without the limit."""
    capped, capped_arrays = _fit(tmp_path, "capped", True, REAL_OOM_HEADROOM_GB)
    free, free_arrays = _fit(tmp_path, "free", False, None)
    assert capped["ooms"] >= 1, "MemFit met no OOM: the test proves nothing"
    assert max(capped["split"]) > 1
    assert capped["iterations"] == free["iterations"] == 4
    assert capped["history"].keys() == free["history"].keys()
    for name, values in free["history"].items():
        np.testing.assert_allclose(capped["history"][name], values, rtol=1e-5, err_msg=name)
    assert len(capped_arrays) == len(free_arrays)
    # Float rounding only: the micro-batches' gradients are summed in another
    # order. A convolution's bias gradient (and its momentum, about 1e-3) is a
    # sum over 2,048 x 576 positions that largely cancel (measured: 1e-6 apart
    # on one of conv2's biases after 4 steps); a wrong weighting of the
    # micro-batches moves them by a share of their own size.
    for a, b in zip(capped_arrays, free_arrays):  # weights, iterations, momenta
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=5e-6)
