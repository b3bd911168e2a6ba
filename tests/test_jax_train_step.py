"""MemFit's JAX train step: a gradient program that donates nothing, then an in-place update.

Keras's JAX step donates the model's state, which an OOM then destroys;
keras_memfit's runs the forward and backward pass as one program that
donates nothing (where an OOM happens) and the optimizer update as a second
one that works in place (see `keras_memfit/backend/jax/training.py`). These
tests check that this holds no more memory than Keras's own step (XLA's
buffer analysis of both, and the widest model under a real address-space
limit), that a real OOM in the gradient program mid-fit leaves a training
equal to the unlimited fit (the logs every callback read too), and that a
failed update is reported as one. Each runs in a child process with Keras
on JAX (`tests/jax_support.py`).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tests.jax_support import (
    REAL_OOM_FITS,
    REAL_OOM_LIMIT_GB,
    REAL_OOM_ROWS,
    hide_address_space_limit,
    real_oom_batches,
    real_oom_model,
    requires_jax,
    run_in_jax,
    small_data,
    small_model,
)

pytestmark = requires_jax

_ALLOC = "RESOURCE_EXHAUSTED: Out of memory allocating 6400000000 bytes."


_model = small_model
_data = small_data


def _log_readers():
    import keras

    class Reader(keras.callbacks.Callback):
        """Reads every batch's logs on Keras's loop thread (a batch-end hook)."""

        def __init__(self):
            super().__init__()
            self.read = {}
            self.epoch = None

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            assert (self.epoch, batch) not in self.read, (self.epoch, batch)
            self.read[self.epoch, batch] = dict(logs)

        @property
        def logs(self):
            """The logs read, in (epoch, batch) order."""
            return [self.read[key] for key in sorted(self.read)]

    class AsyncReader(Reader):
        """The same, on Keras's callback thread pool (`async_safe`): its workers
        may read the batches in any order (Keras's epoch end waits for them all)."""

        async_safe = True

    return Reader(), AsyncReader()


def _assert_same_logs(got, expected):
    assert len(got) == len(expected), (len(got), len(expected))
    for mine, theirs in zip(got, expected):
        assert set(mine) == set(theirs)
        for name in theirs:
            np.testing.assert_allclose(mine[name], theirs[name], rtol=1e-5, err_msg=name)


def child_real_oom_in_a_gradient_program(out):
    """A fit whose third batch is larger than the limit allows, after two that fit."""
    import keras_memfit

    batches, _, _ = real_oom_batches(
        [REAL_OOM_FITS, REAL_OOM_FITS, REAL_OOM_ROWS // 2, REAL_OOM_FITS])
    model = real_oom_model()
    memfit = keras_memfit.MemFit()
    callbacks = [memfit]
    reader = {"": None, "sync": 0, "async": 1}[os.environ.get("KERAS_MEMFIT_READER", "")]
    if reader is not None:
        # "sync" reads each batch's logs on Keras's loop thread, "async" on Keras's
        # callback threads: either must read the logs of the batch run again.
        reader = _log_readers()[reader]
        callbacks.append(reader)
    history = model.fit(batches, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
    np.savez(out + ".npz", *model.get_weights(),
             *[np.asarray(v.value) for v in model.optimizer.variables])
    with open(out + ".json", "w") as f:
        json.dump({
            "history": {k: v for k, v in history.history.items() if not k.startswith("memfit")},
            "iterations": int(model.optimizer.iterations.value),
            "ooms": [e["step"] for e in memfit.events if e["kind"] == "oom"],
            "logs": None if reader is None else [
                {k: float(v) for k, v in logs.items()} for logs in reader.logs],
        }, f)


def child_real_oom_run():
    hide_address_space_limit()  # a real OOM in the gradient program: the limit unknown
    child_real_oom_in_a_gradient_program(os.environ["KERAS_MEMFIT_JAX_OUT"])


@pytest.mark.parametrize("reader", ["", "sync", "async"], ids=[
    "no-reader", "logs-read-by-a-callback", "logs-read-on-keras-callback-threads"])
def test_a_real_oom_in_the_gradient_program_equals_the_unlimited_fit(tmp_path, reader):
    free, limited = str(tmp_path / "free"), str(tmp_path / "limited")
    run_in_jax(__file__, "child_real_oom_run",
               env={"KERAS_MEMFIT_JAX_OUT": free, "KERAS_MEMFIT_READER": reader})
    run_in_jax(__file__, "child_real_oom_run", address_space_gb=REAL_OOM_LIMIT_GB,
               env={"KERAS_MEMFIT_JAX_OUT": limited, "KERAS_MEMFIT_READER": reader})
    with open(free + ".json") as f:
        reference = json.load(f)
    with open(limited + ".json") as f:
        result = json.load(f)
    assert reference["ooms"] == [] and result["ooms"] and set(result["ooms"]) == {2}, result
    assert result["iterations"] == reference["iterations"] == 4
    for name, values in reference["history"].items():
        np.testing.assert_allclose(result["history"][name], values, rtol=1e-4)
    expected, got = np.load(free + ".npz"), np.load(limited + ".npz")
    for key in expected.files:
        np.testing.assert_allclose(got[key], expected[key], rtol=1e-4, atol=1e-6)
    if reader:  # every batch's logs as the reader read them, the failed batch's rerun too
        assert len(result["logs"]) == len(reference["logs"]) == 4
        _assert_same_logs(result["logs"], reference["logs"])


# ------------------------------------------------ memory: no more than Keras's step
def _wide_model(width):
    """Input(1024) -> Dense(width, relu) -> Dense(1024), Adam, mse, seeded (as benchmarks/footprint)."""
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((1024,)),
        keras.layers.Dense(width, activation="relu"),
        keras.layers.Dense(1024),
    ])
    model.compile(optimizer="adam", loss="mse")
    return model


def child_the_two_programs_hold_no_more_than_keras_step():
    """XLA's own buffer analysis: MemFit's gradient program (with the state held
    beside it) and its update program each need at most what Keras's donating
    step needs, where the weights dominate (batch 8) and where the activations do."""
    import jax

    from keras_memfit.backend.jax import state, training

    def live(analysis):  # what a program holds while it runs, beyond donated inputs
        return (analysis.argument_size_in_bytes + analysis.output_size_in_bytes
                - analysis.alias_size_in_bytes + analysis.temp_size_in_bytes)

    def nbytes(arrays):
        return sum(a.size * a.dtype.itemsize for a in arrays)

    for width, rows in ((8192, 8), (256, 8192)):
        model = _wide_model(width)
        rng = np.random.default_rng(0)
        x = rng.random((rows, 1024), dtype=np.float32)
        y = rng.random((rows, 1024), dtype=np.float32)
        model.fit(x[:8], y[:8], verbose=0)  # builds the optimizer and the metrics
        current = state.get(model, training.TRAIN_STATE)
        keras_peak = live(jax.jit(model.train_step, donate_argnums=0).lower(
            tuple(current), (x, y)).compile().memory_analysis())
        step = training.make_train_step(model)
        gradients = step._gradients.lower(*current, (x, y)).compile().memory_analysis()
        assert gradients.alias_size_in_bytes == 0  # donates nothing: an OOM there loses nothing
        held = nbytes(a for group in current for a in group) + x.nbytes + y.nbytes
        gradient_peak = held + gradients.output_size_in_bytes + gradients.temp_size_in_bytes
        trainable, _, optimizer, _ = current
        grads = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in trainable]
        update = step._update.lower(trainable, optimizer, grads).compile().memory_analysis()
        # in place: every weight and optimizer variable written into its own buffer
        assert update.alias_size_in_bytes == nbytes(trainable) + nbytes(optimizer)
        update_peak = (held - update.alias_size_in_bytes + live(update))
        assert max(gradient_peak, update_peak) <= 1.02 * keras_peak, (
            width, rows, gradient_peak, update_peak, keras_peak)
        # The check can fail: Keras's step compiled without donation (the
        # design this replaced held the old and new state together) does.
        whole = live(jax.jit(model.train_step).lower(tuple(current), (x, y)).compile()
                     .memory_analysis())
        assert whole > 1.02 * keras_peak, (width, rows, whole, keras_peak)


WIDE_LIMIT_GB = 5
# Under WIDE_LIMIT_GB, plain Keras trains Dense(WIDE) at batch 8 (measured: up to
# about 86,000 wide, and MemFit too); MemFit's earlier step, which held the old and
# the new state together, failed above about 58,000.
WIDE = 75_000


def child_wide_fit():
    """Two steps of the wide model at batch 8, plain or with MemFit ($KERAS_MEMFIT_WIDE_MODE)."""
    import keras_memfit

    model = _wide_model(WIDE)
    rng = np.random.default_rng(0)
    x = rng.random((16, 1024), dtype=np.float32)
    y = rng.random((16, 1024), dtype=np.float32)
    memfit = os.environ["KERAS_MEMFIT_WIDE_MODE"] == "memfit"
    history = model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
                        callbacks=[keras_memfit.MemFit()] if memfit else [])
    sample = np.random.default_rng(1)
    summary = {
        "loss": history.history["loss"],
        "iterations": int(model.optimizer.iterations.value),
        # the weights and slots, summarised: sums and a fixed sample of entries
        "sums": [float(np.asarray(v.value, np.float64).sum())
                 for v in model.trainable_variables + model.optimizer.variables],
        "sample": [np.asarray(v.value).ravel()[
            sample.integers(0, v.value.size, 1000)].tolist() for v in model.trainable_variables],
    }
    with open(os.environ["KERAS_MEMFIT_JAX_OUT"], "w") as f:
        json.dump(summary, f)


def child_a_failed_update_is_reported():
    """The update program that failed (its error shows in the next gradient program,
    which took its outputs) makes the step say `UPDATE_BEGAN`, and MemFit raises
    its OutOfMemoryError saying so instead of retrying; a failed dispatch of the
    update that deleted nothing is `UNTOUCHED`."""
    import jax

    import keras_memfit
    from keras_memfit.backend.base import StepOutcome
    from keras_memfit.backend.jax import state, training

    class FailedUpdate:
        def is_deleted(self):
            return False

        def block_until_ready(self):
            raise jax.errors.JaxRuntimeError(_ALLOC)

    def consequence(*args):
        raise jax.errors.JaxRuntimeError("INTERNAL: an input of this computation failed")

    x, y = _data()
    model = _model()
    model.fit(x[:16], y[:16], verbose=0)
    step = training.make_train_step(model)
    step((x[:16], y[:16]))
    step._last_update, step._gradients = FailedUpdate(), consequence
    try:
        step((x[:16], y[:16]))
    except jax.errors.JaxRuntimeError as err:
        assert "RESOURCE_EXHAUSTED" in str(err), err  # the update's own error
    else:
        raise AssertionError("a failed update went unreported")
    assert step.last_outcome is StepOutcome.UPDATE_BEGAN

    step = training.make_train_step(model)
    before = [np.array(a) for a in state.get(model, ("trainable",))[0]]

    def refused(trainable, optimizer, grads):
        raise jax.errors.JaxRuntimeError(_ALLOC)

    step._update = refused
    try:
        step((x[:16], y[:16]))
    except jax.errors.JaxRuntimeError:
        pass
    assert step.last_outcome is StepOutcome.UNTOUCHED
    for a, b in zip(state.get(model, ("trainable",))[0], before):
        np.testing.assert_array_equal(np.asarray(a), b)

    # Through MemFit: the third step's gradient program shows the second's update failed.
    call = training.TrainStep.__call__
    calls = [0]

    def failing_call(self, data):
        calls[0] += 1
        if calls[0] == 3:
            self._last_update, self._gradients = FailedUpdate(), consequence
        return call(self, data)

    training.TrainStep.__call__ = failing_call
    try:
        _model().fit(x, y, batch_size=16, epochs=1, verbose=0,
                     callbacks=[keras_memfit.MemFit()])
    except keras_memfit.OutOfMemoryError as err:
        assert "optimizer update" in str(err) and "lost" in str(err), str(err)
    else:
        raise AssertionError("MemFit went on after a failed update")
    finally:
        training.TrainStep.__call__ = call
    assert calls[0] == 3, calls  # not retried


def test_the_two_programs_hold_no_more_memory_than_keras_step():
    run_in_jax(__file__, "child_the_two_programs_hold_no_more_than_keras_step")


def test_memfit_trains_a_width_plain_keras_trains_under_a_real_limit(tmp_path):
    results = {}
    for mode in ("plain", "memfit"):
        out = str(tmp_path / f"{mode}.json")
        run_in_jax(__file__, "child_wide_fit", address_space_gb=WIDE_LIMIT_GB,
                   env={"KERAS_MEMFIT_JAX_OUT": out, "KERAS_MEMFIT_WIDE_MODE": mode})
        with open(out) as f:
            results[mode] = json.load(f)
    plain, memfit = results["plain"], results["memfit"]
    assert memfit["iterations"] == plain["iterations"] == 2
    np.testing.assert_allclose(memfit["loss"], plain["loss"], rtol=1e-6)
    np.testing.assert_allclose(memfit["sums"], plain["sums"], rtol=1e-5)
    for got, expected in zip(memfit["sample"], plain["sample"]):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)


def test_a_failed_update_program_is_reported_not_retried():
    run_in_jax(__file__, "child_a_failed_update_is_reported")


# ------------------------------ batch 1: Keras's fused step where the two programs do not fit
BATCH_ONE_WIDE = 32_768  # weights P = 256 MiB: the two programs need 1.5 P, Keras's step P / 2
# x P of address space left once the model and Adam's slots exist; measured with
# MALLOC_ARENA_MAX=1 (2026-12-03): one plain fit of the two rows needed from 1.75 to
# over 2.1 from run to run, as Keras's loop lets the second step allocate while the
# first one's temporaries (P / 2) are alive (its peak 1.23 P or 1.76 P, more under
# load); so the reference runs each step in a fit of its own (see the child). The two
# programs fail up to 2.8 (they fit at 3.0). MemFit picks Keras's fused step up to 2.1
# (at 2.2 its "tight" two programs train instead).
BATCH_ONE_HEADROOM = float(os.environ.get("KERAS_MEMFIT_HEADROOM", 2.1))


def child_batch_one_fit():
    """Two steps at batch 1 of the wide model under an address-space limit set 2.1 P
    above what the model, its Adam slots and JAX already hold: Keras's fused
    step (temporaries about P / 2: XLA fuses a rank-one gradient into its
    update) fits, MemFit's two programs (all gradients, P, then the update)
    do not. $KERAS_MEMFIT_WIDE_MODE: "plain" Keras, "memfit", or "split"
    (MemFit forced to its two programs, which must then run out of memory)."""
    import logging
    import resource
    import threading

    import jax

    import keras_memfit
    from keras_memfit.backend.jax import training

    mode = os.environ["KERAS_MEMFIT_WIDE_MODE"]
    if mode == "split":
        training.TrainStep._choose = lambda self, model, current, data: "split"
    model = _wide_model(BATCH_ONE_WIDE)
    model.optimizer.build(model.trainable_variables)  # the slots exist before the limit
    rng = np.random.default_rng(0)
    x = rng.random((2, 1024), dtype=np.float32)
    y = rng.random((2, 1024), dtype=np.float32)
    weights = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
    with open("/proc/self/status") as status:
        in_use = next(int(line.split()[1]) * 1024 for line in status
                      if line.startswith("VmSize:"))
    limit = in_use + int(BATCH_ONE_HEADROOM * weights)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    # Keras's callback threads, started in fit, would each reserve an 8 MiB stack
    # inside the limit (P / 32 apiece). MemFit's fused step ran out of memory
    # once at 2.1 P on a loaded machine (2026-12-04; cause not found: alone it
    # trains at 1.8 P); these stacks at least are kept out of the margin.
    threading.stack_size(256 * 2**10)

    class Warnings(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    warnings = Warnings()
    logging.getLogger("keras_memfit").addHandler(warnings)
    summary = {"fused_warnings": 0}
    # Each row in a fit of its own, in every mode: the same two updates as one
    # fit of both rows (Adam's state carries over), but Keras's loop cannot start
    # the second step while the first one's temporaries are alive, which made
    # plain Keras's peak vary by P / 2 from run to run (it failed at 2.0 P and
    # 2.1 P on loaded CI machines; MemFit's fused step, in one fit, failed three
    # runs in a row at 2.1 P in one loaded CI run). One MemFit for both fits, as
    # a user's callback list would hold it. The loss is the mean of the two steps'.
    callbacks = [] if mode == "plain" else [keras_memfit.MemFit()]
    try:
        losses = []
        for row in range(2):
            losses += model.fit(x[row:row + 1], y[row:row + 1], batch_size=1, epochs=1,
                                shuffle=False, verbose=0, callbacks=callbacks).history["loss"]
            jax.block_until_ready([v.value for v in model.variables])  # a failure surfaces
        loss = [float(np.mean(losses))]
    except Exception as err:  # noqa: BLE001 - the outcome the test checks
        summary["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        summary["oom"] = bool(keras_memfit.is_oom_error(err))
    else:
        sample = np.random.default_rng(1)
        summary.update({
            "loss": loss,
            "iterations": int(model.optimizer.iterations.value),
            # Summed in float64 without a float64 copy: the limit leaves no room for one.
            "sums": [float(np.asarray(v.value).sum(dtype=np.float64))
                     for v in model.trainable_variables + model.optimizer.variables],
            "sample": [np.asarray(v.value).ravel()[
                sample.integers(0, v.value.size, 1000)].tolist()
                for v in model.trainable_variables],
        })
    summary["fused_warnings"] = sum("Keras's own fused train step" in m
                                    for m in warnings.messages)
    with open(os.environ["KERAS_MEMFIT_JAX_OUT"], "w") as f:
        json.dump(summary, f)


# Tries per run of the plain reference and of MemFit: both run Keras's fused step
# there, whose peak under this limit varies from run to run (plain failed at P / 2 in
# 2 of 10 runs on a loaded machine, 2026-12-04), so each gets the same number of
# fresh processes and must train in one of them.
BATCH_ONE_TRIES = 3


def _batch_one_run(tmp_path, mode, tries):
    """The child's summary of the first of `tries` fresh runs that trained (else the last)."""
    for attempt in range(tries):
        out = str(tmp_path / f"{mode}-{attempt}.json")
        run_in_jax(__file__, "child_batch_one_fit",
                   env={"KERAS_MEMFIT_JAX_OUT": out, "KERAS_MEMFIT_WIDE_MODE": mode,
                        "MALLOC_ARENA_MAX": "1"})
        with open(out) as f:
            summary = json.load(f)
        if "error" not in summary:
            break
    return summary


def test_memfit_trains_at_batch_one_where_plain_keras_does_and_its_two_programs_do_not(
        tmp_path):
    plain = _batch_one_run(tmp_path, "plain", BATCH_ONE_TRIES)
    split = _batch_one_run(tmp_path, "split", 1)
    memfit = _batch_one_run(tmp_path, "memfit", BATCH_ONE_TRIES)
    assert "error" not in plain, plain  # plain Keras trains under this limit
    # the two programs do not fit there (MemFit before it ran Keras's step there)
    assert split.get("oom") and "OutOfMemoryError" in split["error"], split
    assert "error" not in memfit, memfit
    assert memfit["fused_warnings"] == 1, memfit  # one shape, one warning
    assert memfit["iterations"] == plain["iterations"] == 2
    np.testing.assert_allclose(memfit["loss"], plain["loss"], rtol=1e-6)
    np.testing.assert_allclose(memfit["sums"], plain["sums"], rtol=1e-5)
    for got, expected in zip(memfit["sample"], plain["sample"]):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)


def child_a_failed_fused_step_is_reported():
    """Keras's fused step (run where the two programs would not fit) that runs out of
    memory has lost its donated state: the step says `UPDATE_BEGAN` and MemFit
    raises its OutOfMemoryError saying so, without retrying."""
    import jax

    import keras_memfit
    from keras_memfit.backend.base import StepOutcome
    from keras_memfit.backend.jax import training

    calls = [0]

    def fused_and_failing(self, model, current, data):
        calls[0] += 1

        def fails(state, data):  # as a donating program that could not allocate
            for group in state:
                for a in group:
                    a.delete()
            raise jax.errors.JaxRuntimeError(_ALLOC)

        self._fused = fails
        return "fused"

    training.TrainStep._choose = fused_and_failing
    x, y = _data()
    model = _model()
    step = training.make_train_step(model)
    try:
        step((x[:16], y[:16]))
    except jax.errors.JaxRuntimeError:
        pass
    else:
        raise AssertionError("the failed fused step went unreported")
    assert step.last_outcome is StepOutcome.UPDATE_BEGAN
    model = _model()
    try:
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[keras_memfit.MemFit()])
    except keras_memfit.OutOfMemoryError as err:
        assert "lost" in str(err), str(err)
    else:
        raise AssertionError("MemFit went on after a failed fused step")
    assert calls[0] == 2, calls  # one shape each: not retried


def test_a_failed_fused_step_is_reported_not_retried():
    run_in_jax(__file__, "child_a_failed_fused_step_is_reported")
