"""safe_predict and safe_evaluate on JAX keep one piece started ahead (`runner.run_in_pieces`).

Keras's JAX loops dispatch the next batch while the last one computes; so do
keras_memfit's, when no callback has a batch-level hook. These tests check,
in child processes with Keras on JAX (`tests/jax_support.py`), that a real
out-of-memory error found when waiting for a piece, while the piece after it
already runs on its state, leaves the model as it was and the results equal
plain Keras at a batch that fits; and that a callback with batch hooks gets
Keras's order (each piece waited for before the next starts).
"""

from __future__ import annotations

import numpy as np

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

# Batches of a PyDataset: the third does not fit under the limit, the others do.
_SIZES = [REAL_OOM_FITS, REAL_OOM_FITS, REAL_OOM_ROWS, REAL_OOM_FITS]


def _record():
    """Record every start and wait of keras_memfit's JAX predict and test steps, in
    order: ("start", rows) and ("wait", rows, succeeded)."""
    from keras_memfit.backend.jax import steps

    calls = []

    class Recorded:
        def __init__(self, started, rows):
            self.started, self.rows = started, rows

        def wait(self):
            try:
                result = self.started.wait()
            except BaseException:
                calls.append(("wait", self.rows, False))
                raise
            calls.append(("wait", self.rows, True))
            return result

        def undo(self):
            self.started.undo()

    def recording(cls):
        start = cls.start

        def recorded(self, data):
            leaf = data if cls is steps.PredictStep else data[0]
            rows = int(np.shape(leaf)[0])
            calls.append(("start", rows))
            return Recorded(start(self, data), rows)

        cls.start = recorded

    recording(steps.PredictStep)
    recording(steps.TestStep)
    return calls


def _failed_while_the_next_ran(calls):
    """A wait of the over-large batch failed after the batch after it had started."""
    failed = calls.index(("wait", REAL_OOM_ROWS, False))
    return ("start", REAL_OOM_FITS) in calls[calls.index(("start", REAL_OOM_ROWS)):failed]


def child_real_oom_on_a_piece_started_ahead():
    import keras_memfit
    hide_address_space_limit()

    calls = _record()
    model = real_oom_model()
    weights = model.get_weights()
    batches, x, y = real_oom_batches(_SIZES, with_targets=False)
    expected = model.predict(x, batch_size=REAL_OOM_FITS, verbose=0)
    calls.clear()
    got = keras_memfit.safe_predict(model, batches, verbose=0)
    assert _failed_while_the_next_ran(calls), calls
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)

    batches, x, y = real_oom_batches(_SIZES)
    expected = model.evaluate(x, y, batch_size=REAL_OOM_FITS, verbose=0, return_dict=True)
    calls.clear()
    got = keras_memfit.safe_evaluate(model, batches, verbose=0, return_dict=True)
    assert _failed_while_the_next_ran(calls), calls
    assert set(got) == set(expected)
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, err_msg=name)
    for before, after in zip(weights, model.get_weights()):  # readable, unchanged
        np.testing.assert_array_equal(before, after)


def child_batch_hooks_get_keras_order():
    import keras

    import keras_memfit

    calls = _record()
    model = small_model()
    x, y = small_data()
    expected = model.predict(x, batch_size=16, verbose=0)

    class Ends(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.ends = []

        def on_predict_batch_end(self, batch, logs=None):
            self.ends.append(batch)
            calls.append(("end", batch))

    def overlapped():
        return any(a[0] == "start" and b[0] == "start" for a, b in zip(calls, calls[1:]))

    got = keras_memfit.safe_predict(model, x, batch_size=16, verbose=0)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
    assert overlapped(), calls  # no batch hook: started ahead

    calls.clear()
    ends = Ends()
    got = keras_memfit.safe_predict(model, x, batch_size=16, verbose=0, callbacks=[ends])
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
    assert not overlapped(), calls
    assert ends.ends == list(range(10))
    # Keras's order: each batch's end before the next batch starts.
    starts = [i for i, c in enumerate(calls) if c[0] == "start"]
    ends_at = [i for i, c in enumerate(calls) if c[0] == "end"]
    assert all(end < start for end, start in zip(ends_at, starts[1:])), calls


def test_a_real_oom_on_a_piece_started_ahead_equals_keras_at_a_batch_that_fits():
    run_in_jax(__file__, "child_real_oom_on_a_piece_started_ahead",
               address_space_gb=REAL_OOM_LIMIT_GB)


def test_a_callback_with_batch_hooks_sees_each_piece_end_before_the_next_starts():
    run_in_jax(__file__, "child_batch_hooks_get_keras_order")
