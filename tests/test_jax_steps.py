"""How keras_memfit's JAX steps hold the model's state (the overhead work of issue 14).

Inside Keras's loops MemFit's functions work on Keras's own state tuple, not
on the variables, and the train step's update program writes the new state
in place, as Keras's own donating step does; safe_predict takes the model's
variable lists once per call. Each check runs in a child process
with Keras on JAX (`tests/jax_support.py`); the references are plain Keras.
"""

from __future__ import annotations

import numpy as np

from tests.jax_support import requires_jax, run_in_jax, small_data, small_model

pytestmark = requires_jax


_model = small_model
_data = small_data


def child_memfit_threads_keras_state_and_updates_in_place():
    import keras

    import keras_memfit

    x, y = _data()

    writes = [0]  # every write of a variable's value (`assign` too) ends in _direct_assign
    variable_class = type(_model().weights[0])
    direct_assign = variable_class._direct_assign

    def counting_direct_assign(self, value):
        writes[0] += 1
        return direct_assign(self, value)

    class Holder(keras.callbacks.Callback):
        """Keeps the arrays of the weights after every batch, and copies of them."""

        def __init__(self):
            super().__init__()
            self.held = []

        def on_train_batch_end(self, batch, logs=None):
            values = [v.value for v in self.model.trainable_variables]
            self.held.append((values, [np.array(a) for a in values]))

    reference, reference_holder = _model(), Holder()
    expected = reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                             callbacks=[reference_holder]).history
    model = _model()
    model.optimizer.build(model.trainable_variables)
    n_vars = sum(len(g) for g in (model.trainable_variables, model.non_trainable_variables,
                                  model.optimizer.variables, model.metrics_variables))
    variable_class._direct_assign = counting_direct_assign
    try:
        history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                            callbacks=[keras_memfit.MemFit()]).history
    finally:
        variable_class._direct_assign = direct_assign
    memfit_writes, writes[0] = writes[0], 0
    variable_class._direct_assign = counting_direct_assign
    try:
        plain = _model().fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
    finally:
        variable_class._direct_assign = direct_assign
    # 20 steps: writing every variable per step would be 20 * n_vars writes more
    # than plain Keras's fit (whose syncs write each variable about once per
    # epoch); MemFit's analysis of the model creates a few variables of its own.
    assert memfit_writes <= writes[0] + n_vars // 2, (memfit_writes, writes[0], n_vars)
    for name, values in plain.items():
        np.testing.assert_allclose(history[name], values, rtol=1e-5, err_msg=name)
    model, holder = _model(), Holder()
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                        callbacks=[keras_memfit.MemFit(), holder]).history
    for name, values in expected.items():
        np.testing.assert_allclose(history[name], values, rtol=1e-5, err_msg=name)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # The update program works in place, as Keras's own donating step does: the
    # arrays a callback took are consumed by the next step in both fits, alike.
    assert len(holder.held) == len(reference_holder.held) == 20
    consumed = [[a.is_deleted() for a in values] for values, _ in holder.held]
    assert consumed == [[a.is_deleted() for a in values] for values, _ in reference_holder.held]
    assert any(any(row) for row in consumed), "nothing was updated in place: nothing tested"
    for (_, copies), (_, expected_copies) in zip(holder.held, reference_holder.held):
        for a, b in zip(copies, expected_copies):
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


def test_memfit_works_on_keras_state_and_updates_it_in_place_as_keras_does():
    run_in_jax(__file__, "child_memfit_threads_keras_state_and_updates_in_place")


def test_safe_predict_takes_the_variable_lists_anew_for_each_call():
    run_in_jax(__file__, "child_safe_predict_sees_variables_added_between_calls")
