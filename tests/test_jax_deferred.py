"""MemFit's started, not yet settled, train steps on JAX (`keras_memfit/_deferred.py`).

Keras's JAX loop never waits for a step; MemFit starts a whole batch's step
and settles it one step later (before the next batch, before Keras writes
the state into the variables, when anyone reads its logs). These tests make
a started step fail when it is settled, as a computation that ran out of
memory after it was dispatched does, and check that the training equals
Keras's own fit: the batch ran again, the logs every callback read are the
reference's, the events name the failed batch. One test does it with a real
out-of-memory error under an address-space limit. Each runs in a child
process with Keras on JAX (`tests/jax_support.py`).
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
    assert_same_training,
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


def _fail_settles(numbers):
    """Make the started train steps numbered `numbers` (1-based, in settling order)
    fail when settled, as a step whose computation ran out of memory does: the
    step's own failure path (state put back, later steps dropped), then a JAX OOM.

    The computations themselves succeed, so no reader may trust them: a step's
    `completion` says "not known", and readers on Keras's callback threads wait
    for the loop's thread to settle the step (as they do for a real failure)."""
    import jax

    from keras_memfit.backend.jax import state, training

    start, settle = training.TrainStep.start, training.TrainStep.settle
    count = [0]
    outputs_of = {}  # id of a started step's witness -> every array it returned

    def recording_start(self, data):
        logs = start(self, data)
        new_state = state.get(self._model_ref(), training.TRAIN_STATE)
        outputs_of[id(self._pending[-1][1])] = jax.tree.leaves((logs, new_state))
        return logs

    def failing_settle(self):
        if not self._pending:
            return settle(self)
        count[0] += 1
        if count[0] in numbers:
            # A failed computation's outputs are unusable, and so are those of the
            # steps that took them as input: deleted here, so any use of them raises.
            inputs = {id(a) for group in self._pending[0][0] for a in group}
            outputs = [a for _, witness in self._pending for a in outputs_of[id(witness)]]
            self._roll_back()
            for a in outputs:
                if id(a) not in inputs and not a.is_deleted():
                    a.delete()
            raise jax.errors.JaxRuntimeError(_ALLOC)
        return settle(self)

    training.TrainStep.start = recording_start
    training.TrainStep.settle = failing_settle
    training.TrainStep.completion = lambda self: lambda: False
    return count


def _restore_train_step(start, settle, completion):
    from keras_memfit.backend.jax import training

    training.TrainStep.start = start
    training.TrainStep.settle = settle
    training.TrainStep.completion = completion


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


def child_a_step_that_fails_when_settled_runs_its_batch_again():
    import logging

    import keras_memfit
    from keras_memfit.backend.jax import training

    x, y = _data()  # 10 batches of 16 per epoch
    reference = _model()
    reader, _ = _log_readers()
    expected = reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                             callbacks=[reader]).history
    expected_logs = reader.logs
    originals = (training.TrainStep.start, training.TrainStep.settle,
                 training.TrainStep.completion)
    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("keras_memfit").addHandler(handler)

    # The first batch runs unstarted (it compiles); batch k >= 1 is settled k-th. A
    # reader on Keras's loop thread settles each batch as it reads its logs: settle 3
    # fails before batch 4 starts; settle 8 is an OOM of batch 8 (the overlap ended).
    # With the reader on Keras's callback threads, batches are settled one call later:
    # settle 3 fails while batch 4 overlaps it (both run again, batch 3 whole once
    # more); settle 8 is batch 9's, when Keras syncs the state at the end of epoch 0.
    sync_reader, async_reader = _log_readers()
    for readers, oom_batch in ((sync_reader, 8), (async_reader, 9)):
        count = _fail_settles({3, 8})
        warnings.clear()
        model = _model()
        memfit = keras_memfit.MemFit()
        try:
            history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                                callbacks=[memfit, readers]).history
        finally:
            _restore_train_step(*originals)
        assert count[0] >= 8, count[0]
        ooms = [(e["epoch"], e["step"]) for e in memfit.events if e["kind"] == "oom"]
        assert ooms == [(0, oom_batch)], memfit.events
        assert any("batch 3 of epoch 0" in w and "overlap" in w for w in warnings), warnings
        assert history["memfit_ooms"] == [2, 0], history
        assert_same_training(model, {k: v for k, v in history.items() if k in expected},
                             reference, expected, iterations=20)
        _assert_same_logs(readers.logs, expected_logs)


def child_settled_steps_leave_nothing_behind_and_equal_keras():
    import keras

    import keras_memfit

    x, y = _data()
    reference = _model()
    expected = reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                             validation_data=(x[:48], y[:48])).history
    model = _model()
    memfit = keras_memfit.MemFit()

    class Stopper(keras.callbacks.Callback):
        """Reads the model in the middle of an epoch (Keras syncs the state then)."""

        def on_train_batch_end(self, batch, logs=None):
            if batch == 4:
                assert np.all(np.isfinite(self.model.get_weights()[0]))

    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                        validation_data=(x[:48], y[:48]),
                        callbacks=[memfit, Stopper()]).history
    assert memfit.events == [] and not memfit._run.pending
    assert "jax_state_sync" not in model.__dict__  # the settling hook is gone
    assert_same_training(model, history, reference, expected, iterations=20)


def child_real_oom_on_a_started_step(out):
    """A fit whose third batch is larger than the limit allows, after two that fit."""
    import keras_memfit

    batches, _, _ = real_oom_batches(
        [REAL_OOM_FITS, REAL_OOM_FITS, REAL_OOM_ROWS // 2, REAL_OOM_FITS])
    model = real_oom_model()
    memfit = keras_memfit.MemFit()
    callbacks = [memfit]
    reader = {"": None, "sync": 0, "async": 1}[os.environ.get("KERAS_MEMFIT_READER", "")]
    if reader is not None:
        # "sync" reads each batch's logs on Keras's loop thread, outside MemFit's
        # train function: the failed step is settled (and its batch run again)
        # there. "async" reads them on Keras's callback threads: a reader there
        # waits for the step's computation, and for a failed one, until the loop's
        # thread has run the batch again.
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
    hide_address_space_limit()  # a real OOM on a started step: the limit unknown
    child_real_oom_on_a_started_step(os.environ["KERAS_MEMFIT_JAX_OUT"])


def test_a_started_step_that_fails_when_settled_trains_as_keras():
    run_in_jax(__file__, "child_a_step_that_fails_when_settled_runs_its_batch_again")


def test_started_steps_are_settled_by_the_end_of_fit_and_train_as_keras():
    run_in_jax(__file__, "child_settled_steps_leave_nothing_behind_and_equal_keras")


@pytest.mark.parametrize("reader", ["", "sync", "async"], ids=[
    "no-reader", "logs-read-by-a-callback", "logs-read-on-keras-callback-threads"])
def test_a_real_oom_on_a_started_step_equals_the_unlimited_fit(tmp_path, reader):
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
