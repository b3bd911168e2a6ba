"""How keras_memfit's JAX steps hold the model's state (the overhead work of issue 14).

Inside Keras's loops MemFit's functions work on Keras's own state tuple, not
on the variables, and the train step writes its new state into the buffers
of a superseded state that nothing else holds; safe_predict takes the
model's variable lists once per call. Each check runs in a child process
with Keras on JAX (`tests/jax_support.py`); the references are plain Keras.
"""

from __future__ import annotations

import numpy as np

from tests.jax_support import requires_jax, run_in_jax, small_data, small_model

pytestmark = requires_jax


_model = small_model
_data = small_data


def child_memfit_threads_keras_state_and_donates_only_spare_buffers():
    import keras

    import keras_memfit
    from keras_memfit.backend.jax import training

    x, y = _data()
    reference = _model()
    expected = reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history

    writes = [0]  # every write of a variable's value (`assign` too) ends in _direct_assign
    variable_class = type(reference.weights[0])
    direct_assign = variable_class._direct_assign

    def counting_direct_assign(self, value):
        writes[0] += 1
        return direct_assign(self, value)

    donated = [0]
    spare_buffers = training.TrainStep._spare_buffers

    def counting_spare_buffers(self, current):
        found = spare_buffers(self, current)
        donated[0] += found is not None
        return found

    model = _model()
    model.optimizer.build(model.trainable_variables)
    n_vars = sum(len(g) for g in (model.trainable_variables, model.non_trainable_variables,
                                  model.optimizer.variables, model.metrics_variables))
    variable_class._direct_assign = counting_direct_assign
    training.TrainStep._spare_buffers = counting_spare_buffers
    try:
        history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                            callbacks=[keras_memfit.MemFit()]).history
    finally:
        variable_class._direct_assign = direct_assign
        training.TrainStep._spare_buffers = spare_buffers
    # 20 steps: writing every variable per step would be 20 * n_vars writes or more;
    # Keras's own syncs (end of each epoch) write each variable about once per epoch.
    assert writes[0] <= 3 * n_vars, (writes[0], n_vars)
    assert donated[0] >= 15, donated[0]  # every step after the first two of a run
    for name, values in expected.items():
        np.testing.assert_allclose(history[name], values, rtol=1e-5, err_msg=name)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(model.optimizer.variables, reference.optimizer.variables):
        np.testing.assert_allclose(np.asarray(a.value), np.asarray(b.value), rtol=1e-5,
                                   atol=1e-6)

    class Holder(keras.callbacks.Callback):
        """Keeps the arrays of the weights after every batch (Keras's own fit donates them)."""

        def __init__(self):
            super().__init__()
            self.held = []

        def on_train_batch_end(self, batch, logs=None):
            values = [v.value for v in self.model.trainable_variables]
            self.held.append((values, [np.array(a) for a in values]))

    model = _model()
    holder = Holder()
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
              callbacks=[keras_memfit.MemFit(), holder])
    assert len(holder.held) == 20
    for values, copies in holder.held:  # never donated: still readable, unchanged
        for a, copy in zip(values, copies):
            assert not a.is_deleted()
            np.testing.assert_array_equal(np.asarray(a), copy)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def child_safe_predict_sees_variables_added_between_calls():
    from keras_memfit import safe_evaluate, safe_predict

    x, y = _data(64)
    model = _model()
    np.testing.assert_allclose(safe_predict(model, x, batch_size=16, verbose=0),
                               model.predict(x, batch_size=16, verbose=0), rtol=1e-6)
    dense = model.layers[0]
    dense.enable_lora(2)  # new variables: the lists of the first call are stale
    rng = np.random.default_rng(1)
    dense.lora_kernel_b.assign(rng.normal(size=dense.lora_kernel_b.shape) * 0.5)
    expected = model.predict(x, batch_size=16, verbose=0)
    got = safe_predict(model, x, batch_size=16, verbose=0)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    ref = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    mine = safe_evaluate(model, x, y, batch_size=16, verbose=0, return_dict=True)
    for name in ref:
        np.testing.assert_allclose(mine[name], ref[name], rtol=1e-5, err_msg=name)


def test_memfit_works_on_keras_state_and_donates_only_buffers_nothing_else_holds():
    run_in_jax(__file__, "child_memfit_threads_keras_state_and_donates_only_spare_buffers")


def test_safe_predict_takes_the_variable_lists_anew_for_each_call():
    run_in_jax(__file__, "child_safe_predict_sees_variables_added_between_calls")


def child_settle_waits_for_every_array_the_step_writes():
    import keras

    from keras_memfit.backend.jax import state, training

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((1024,)), keras.layers.Dense(1024), keras.layers.Dense(1)]
    )
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    rng = np.random.default_rng(0)
    data = (rng.random((2048, 1024), dtype=np.float32), rng.random((2048, 1), dtype=np.float32))
    model.fit(data[0][:8], data[1][:8], verbose=0)  # builds the optimizer and the metrics
    step = training.make_train_step(model)
    step(data)  # compiles; a step that ran to its end may be started
    assert step.can_defer
    unready_after_start = 0
    for _ in range(3):
        logs = step.start(data)
        written = [a for group in state.get(model, training.TRAIN_STATE) for a in group]
        written += list(logs.values())
        unready_after_start += not all(a.is_ready() for a in written)
        step.settle()
        assert all(a.is_ready() for a in written)
    # The step runs asynchronously, so the check above could have failed.
    assert unready_after_start, "every start finished before it returned: nothing tested"


def test_settle_waits_for_every_array_the_step_writes():
    run_in_jax(__file__, "child_settle_waits_for_every_array_the_step_writes")
