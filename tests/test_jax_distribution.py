"""keras.distribution.DataParallel on two JAX host devices: results equal the unsplit run.

Each test runs its `child_*` function in a child process with Keras on JAX
and two host devices (`run_in_jax(..., devices=2)`, `tests/jax_support.py`);
skipped where jax is not installed. Splits are forced by making keras_memfit's
compiled steps raise a real JAX OOM exception object above a number of rows;
the injection also records how each piece was laid out over the devices.
References: plain Keras under the same DataParallel at a batch that fits,
or (for an input whose length is not a multiple of the devices, which Keras
cannot lay out) plain Keras on one device with the same weights.
"""

from __future__ import annotations

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
from tests.support import assert_same_training

pytestmark = requires_jax

_ALLOC = "RESOURCE_EXHAUSTED: Out of memory allocating 6400000000 bytes."


def _model(seed=0, loss="sparse_categorical_crossentropy"):
    import keras

    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(hidden))
    model.compile("adam", loss, metrics=["accuracy"])
    return model


def _data(rows, seed=1):
    rng = np.random.default_rng(seed)
    return (
        rng.normal(size=(rows, 6)).astype("float32"),
        rng.integers(0, 3, rows),
        rng.random(rows).astype("float32"),
    )


def _layout(data):
    """(rows, rows on each device, laid out over the devices?) of `data`'s first array."""
    import jax
    import keras

    leaf = next(a for a in keras.tree.flatten(data) if a is not None)
    rows = int(np.shape(leaf)[0])
    if not isinstance(leaf, jax.Array):
        return rows, None, False
    per_device = tuple(int(s.data.shape[0]) for s in leaf.addressable_shards)
    return rows, per_device, len(per_device) == 2 and sum(per_device) == rows


def _inject(above):
    """Make keras_memfit's JAX steps raise a real JAX OOM above `above` rows; returns
    the list of `_layout`s of every piece they received."""
    import jax

    from keras_memfit.backend.jax import steps, training

    calls = []

    def wrap(cls, name):
        method = getattr(cls, name)

        def wrapped(self, data, *args):
            calls.append(_layout(data))
            if calls[-1][0] > above:
                raise jax.errors.JaxRuntimeError(_ALLOC)
            return method(self, data, *args)

        setattr(cls, name, wrapped)

    wrap(steps.PredictStep, "start")  # __call__ starts, then waits
    wrap(steps.TestStep, "start")
    wrap(training.TrainStep, "__call__")
    wrap(training.GradientAccumulator, "add")
    return calls


def _assert_laid_out(calls, above, tail_rows=0):
    """Every piece that ran was laid out one half per device (sizes a multiple of
    two), except `tail_rows` trailing rows run replicated on both devices."""
    ran = [c for c in calls if c[0] <= above]
    assert ran, calls
    replicated = [c for c in ran if not c[2]]
    assert all(c[1][0] == c[1][1] and c[0] % 2 == 0 for c in ran if c[2]), calls
    if tail_rows:
        assert replicated and all(c[0] == tail_rows and c[1] == (tail_rows,) * 2
                                  for c in replicated), calls
    else:
        assert not replicated, calls


# ------------------------------------------------------------------ children
def child_predict_and_evaluate():
    """safe_predict and safe_evaluate split over the devices equal the unsplit run,
    for an input whose length is and one whose length is not a multiple of two;
    Keras's predict and evaluate with MemFit too."""
    import jax
    import keras

    import keras_memfit
    from keras_memfit import backend

    assert len(jax.devices()) == 2
    single = _model()  # one device: the reference where Keras cannot lay the rows out
    data_parallel = keras.distribution.DataParallel()
    with data_parallel.scope():
        model = _model()
        assert backend.get().piece_multiple() == 2
    single.set_weights(model.get_weights())
    calls = _inject(above=40)
    for rows in (202, 203):
        x, y, w = _data(rows)
        padded = np.concatenate([x, x[: rows % 2]])
        with data_parallel.scope():
            expected = model.predict(padded, batch_size=len(padded), verbose=0)[:rows]
            calls.clear()
            got = keras_memfit.safe_predict(model, x, batch_size=rows, verbose=0)
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
        _assert_laid_out(calls, 40, tail_rows=rows % 2)
        if rows == 202:  # it ran out of memory (the second call starts where that ended)
            assert any(c[0] > 40 for c in calls), calls
        for kwargs in ({}, {"sample_weight": w}):
            with data_parallel.scope():
                calls.clear()
                got = keras_memfit.safe_evaluate(
                    model, x, y, batch_size=rows, verbose=0, return_dict=True, **kwargs
                )
                _assert_laid_out(calls, 40, tail_rows=rows % 2)
                if rows % 2 == 0:
                    ref = model.evaluate(x, y, batch_size=rows, verbose=0, return_dict=True,
                                         **kwargs)
            if rows % 2:
                ref = single.evaluate(x, y, batch_size=rows, verbose=0, return_dict=True,
                                      **kwargs)
            assert set(got) == set(ref)
            for name in ref:
                np.testing.assert_allclose(got[name], ref[name], rtol=1e-5, err_msg=name)
    with data_parallel.scope():  # batch_size=1 is kept: each row runs whole on both devices
        calls.clear()
        got = keras_memfit.safe_predict(model, x[:3], batch_size=1, verbose=0)
    np.testing.assert_allclose(got, expected[:3], rtol=1e-6, atol=1e-7)
    assert calls == [(1, (1, 1), False)] * 3, calls
    # Keras's predict and evaluate with MemFit: Keras lays out batches of 100.
    x, y, _ = _data(200)
    with data_parallel.scope():
        expected = model.predict(x, batch_size=100, verbose=0)
        reference = model.evaluate(x, y, batch_size=100, verbose=0, return_dict=True)
        calls.clear()
        got = model.predict(x, batch_size=100, verbose=0, callbacks=[keras_memfit.MemFit()])
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
        _assert_laid_out(calls, 40)
        calls.clear()
        logs = model.evaluate(x, y, batch_size=100, verbose=0, return_dict=True,
                              callbacks=[keras_memfit.MemFit()])
        _assert_laid_out(calls, 40)  # (at the size safe_evaluate learnt: no OOM now)
    for name in reference:
        np.testing.assert_allclose(logs[name], reference[name], rtol=1e-5, err_msg=name)


def child_memfit_accumulate():
    """MemFit(accumulate) under DataParallel: the same fit as plain Keras under it,
    pieces laid out over the devices, an uneven (smaller) last batch too."""
    import jax
    import keras

    import keras_memfit

    assert len(jax.devices()) == 2
    x, y, w = _data(232)  # batches of 100, 100 and 32
    calls = _inject(above=40)
    with keras.distribution.DataParallel().scope():
        for kwargs in ({}, {"sample_weight": w}):
            reference = _model()
            expected = reference.fit(
                x, y, batch_size=100, epochs=2, shuffle=False, verbose=0,
                validation_data=(x[:64], y[:64]), **kwargs,
            ).history
            model = _model()
            calls.clear()
            history = model.fit(
                x, y, batch_size=100, epochs=2, shuffle=False, verbose=0,
                validation_data=(x[:64], y[:64]), callbacks=[keras_memfit.MemFit()], **kwargs,
            ).history
            _assert_laid_out(calls, 40)
            # Each batch of 100 in pieces of at most 40 rows (how small the
            # planner goes after an OOM is its own choice: see
            # test_planner_blind.py), the update still the whole batch's.
            assert history["memfit_split"][0] >= 3 and history["memfit_ooms"][0] >= 1
            assert_same_training(model, history, reference, expected, iterations=6)


def child_memfit_accumulate_reductions():
    """MemFit(accumulate) under DataParallel with losses reduced with "sum" and
    "mean_with_sample_weight": the fit of plain Keras under it; a piece of odd rows
    (which Keras's own batches under DataParallel never are) added as its laid-out
    rows and its last row, each part weighted within the piece: Keras's step on
    one device on those rows."""
    import jax
    import keras

    import keras_memfit
    from keras_memfit import backend

    assert len(jax.devices()) == 2
    x, y, w = _data(232)  # batches of 100, 100 and 32
    for reduction in ("sum", "mean_with_sample_weight"):
        loss = lambda: keras.losses.SparseCategoricalCrossentropy(reduction=reduction)  # noqa: E731
        with keras.distribution.DataParallel().scope():
            reference = _model(loss=loss())
            expected = reference.fit(x, y, sample_weight=w, batch_size=100, epochs=2,
                                     shuffle=False, verbose=0).history
            model = _model(loss=loss())
            calls = _inject(above=40)
            history = model.fit(x, y, sample_weight=w, batch_size=100, epochs=2, shuffle=False,
                                verbose=0, callbacks=[keras_memfit.MemFit()]).history
            _assert_laid_out(calls, 40)
            assert history["memfit_split"][0] >= 3
            history = {k: v for k, v in history.items() if not k.startswith("memfit_")}
            assert_same_training(model, history, reference, expected, iterations=6)
            model.reset_metrics()
            accumulator = backend.get().make_accumulator(model)
            accumulator.reset()
            accumulator.add((x[:31], y[:31], w[:31]), 1.0, 1.0)
            accumulator.apply()
            logs = model.get_metrics_result()
        single = _model(loss=loss())  # on one device, in the state of the reference
        single.set_weights(reference.get_weights())
        single.optimizer.build(single.trainable_variables)
        for mine, theirs in zip(single.optimizer.variables, reference.optimizer.variables):
            mine.assign(np.asarray(theirs.value))
        expected = single.train_on_batch(x[:31], y[:31], sample_weight=w[:31], return_dict=True)
        for a, b in zip(model.get_weights(), single.get_weights()):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(logs["loss"], expected["loss"], rtol=1e-5)


def child_memfit_remat():
    """MemFit recomputing a layer under DataParallel (`remat=[name]`): the same fit
    as plain Keras under it, and the layer's call recomputed."""
    import jax
    import keras

    import keras_memfit
    from keras_memfit import backend

    assert len(jax.devices()) == 2
    module, made = backend.get(), []
    checkpoint = module.checkpoint
    module.checkpoint = lambda fn: made.append(fn) or checkpoint(fn)
    x, y, _ = _data(64)
    with keras.distribution.DataParallel().scope():
        reference = _model()
        expected = reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
        model = _model()
        history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                            callbacks=[keras_memfit.MemFit(remat=[model.layers[1].name])]).history
    assert made, "no layer was recomputed"
    assert_same_training(model, history, reference, expected, iterations=8)


def child_memfit_shrink():
    """MemFit(shrink) under DataParallel: one update per laid-out piece; equals plain
    Keras fit at the piece size under the same distribution."""
    import jax
    import keras

    import keras_memfit

    assert len(jax.devices()) == 2
    x, y, _ = _data(192)
    with keras.distribution.DataParallel().scope():
        model = _model()
        calls = _inject(above=50)
        model.fit(
            x, y, batch_size=96, epochs=1, shuffle=False, verbose=0,
            callbacks=[keras_memfit.MemFit(mode="shrink")],
        )
        _assert_laid_out(calls, 50)
        pieces = [c[0] for c in calls if c[0] <= 50]  # the pieces that ran, in order
        assert sum(pieces) == 192, calls
        assert int(model.optimizer.iterations.value) == len(pieces)
        # The reference: plain Keras, one train_on_batch per piece, the same rows.
        reference = _model()
        start = 0
        for rows in pieces:
            reference.train_on_batch(x[start:start + rows], y[start:start + rows])
            start += rows
        for a, b in zip(model.get_weights(), reference.get_weights()):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def child_memfit_refuses_other_distributions():
    """ModelParallel: a NotImplementedError naming the case, before any step, the
    model untouched; DataParallel over several processes is accepted (tested for
    real in test_jax_processes.py), its pieces a multiple of the process's local
    devices (both devices here)."""
    import jax
    import keras
    import pytest

    import keras_memfit
    from keras_memfit.backend.jax import distribution

    x, y, _ = _data(64)
    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"],
                                         keras.distribution.list_devices())
    model_parallel = keras.distribution.ModelParallel(
        layout_map=keras.distribution.LayoutMap(mesh), batch_dim_name="batch"
    )
    with model_parallel.scope():
        model = _model()
        before = model.get_weights()
        with pytest.raises(NotImplementedError, match="received model .* under ModelParallel"):
            model.fit(x, y, batch_size=32, verbose=0, callbacks=[keras_memfit.MemFit()])
        for a, b in zip(before, model.get_weights()):
            np.testing.assert_array_equal(a, b)
        assert distribution.piece_multiple() == 1
        # place() answers with its own message, naming the distribution, not MemFit's.
        with pytest.raises(NotImplementedError,
                           match=r"place\(\) cannot pin .* under keras.distribution.ModelParallel"):
            keras_memfit.place(model)
    with keras.distribution.DataParallel().scope():
        model = _model()
        real = jax.process_count
        jax.process_count = lambda *args, **kwargs: 2
        try:
            distribution.check_trainable(model)  # several processes: trains
            assert distribution.piece_multiple() == 2  # each process's local devices
        finally:
            jax.process_count = real
    # Several processes sum every process's rows' mean gradients: the reductions
    # that weigh a piece by its rows only ("mean" too), the rest refused by name.
    from keras_memfit.backend.jax import processes, training

    multi, data_parallel = processes.multi_process, processes.is_data_parallel
    processes.multi_process = processes.is_data_parallel = lambda: True
    try:
        for reduction in ("sum_over_batch_size", "mean"):
            training.check_training_mode(
                _model(loss=keras.losses.MeanSquaredError(reduction=reduction)), "accumulate")
        for reduction in ("sum", "mean_with_sample_weight"):
            with pytest.raises(NotImplementedError, match=f"reduced with '{reduction}'"):
                training.check_training_mode(
                    _model(loss=keras.losses.MeanSquaredError(reduction=reduction)),
                    "accumulate")
    finally:
        processes.multi_process, processes.is_data_parallel = multi, data_parallel
        distribution.check_trainable(model)  # one process: trains


# ------------------------------------------------- real OOMs, two devices
# An address-space limit set before jax starts makes over-large allocations
# fail with a genuine RESOURCE_EXHAUSTED (tests/jax_support.py); the two host
# devices share the process's address space. The full batch of this model
# needs about 4.3 GB of activations (half of it on each device).
#
# Only predict is tested with real OOMs here: a step with a cross-device
# collective (evaluate's metric sums, training's gradient sums) whose
# allocation fails on one host device while the other reaches the collective
# makes XLA's CPU client abort the process after 40 s at the rendezvous
# (measured: `rendezvous.cc ... Termination timeout ... Exiting to ensure a
# consistent program state`), which no Python code can catch. Under the
# shared address-space limit one device's allocation fails alone; the fault
# injection above covers evaluate and fit.
LIMIT_GB = REAL_OOM_LIMIT_GB
ROWS = REAL_OOM_ROWS
FITS = REAL_OOM_FITS


def child_steps_made_outside_the_distribution_are_not_reused_inside():
    from keras_memfit.backend.jax.distribution import ShardedStep
    from keras_memfit.inference.steps import predict_step, test_step_and_guard

    import keras

    model = _model()
    x, y, _ = _data(8)
    outside = predict_step(model), test_step_and_guard(model, (x, y, None))[0]
    with keras.distribution.DataParallel().scope():
        inside = predict_step(model), test_step_and_guard(model, (x, y, None))[0]
        again = predict_step(model), test_step_and_guard(model, (x, y, None))[0]
    after = predict_step(model), test_step_and_guard(model, (x, y, None))[0]
    assert not any(isinstance(step, ShardedStep) for step in outside)
    assert all(isinstance(step, ShardedStep) for step in inside)
    assert again[0] is inside[0] and again[1] is inside[1]  # cached within the variant
    assert after[0] is outside[0] and after[1] is outside[1]


def child_real_oom_predict():
    """Under the limit and DataParallel: plain Keras at the full batch runs out of
    memory; safe_predict equals Keras at a batch that fits, its pieces laid out over
    both devices, and the weights are readable and unchanged after its OOM."""
    import logging

    import jax
    import keras

    import keras_memfit
    from keras_memfit import is_oom_error

    hide_address_space_limit()  # else sized from the limit, without an OOM
    assert len(jax.devices()) == 2
    x = np.random.default_rng(0).random((ROWS, 8), dtype=np.float32)
    ooms = []

    class Handler(logging.Handler):
        def emit(self, record):
            ooms.extend(["oom"] * ("out of memory" in record.getMessage()))

    logging.getLogger("keras_memfit").addHandler(Handler(logging.WARNING))
    with keras.distribution.DataParallel().scope():
        model = real_oom_model()
        expected = model.predict(x, batch_size=FITS, verbose=0)
        weights = model.get_weights()
        calls = _inject(above=ROWS)  # records the layouts; injects nothing
        got = keras_memfit.safe_predict(model, x, batch_size=ROWS, verbose=0)
        assert ooms, "safe_predict met no OOM: the test proves nothing"
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
        assert all(c[2] and c[1][0] == c[1][1] for c in calls), calls
        for a, b in zip(weights, model.get_weights()):
            np.testing.assert_array_equal(a, b)
        try:  # last: plain Keras's OOM destroys the model it donated
            model.predict(x, batch_size=ROWS, verbose=0)
            model.get_weights()
        except jax.errors.JaxRuntimeError as err:
            assert is_oom_error(err), str(err)[:300]
        else:
            raise AssertionError("plain Keras did not run out of memory: the limit is too high")


# --------------------------------------------------------------------- tests
def test_safe_predict_and_safe_evaluate_split_over_two_devices_equal_the_unsplit_run():
    run_in_jax(__file__, "child_predict_and_evaluate", devices=2)


def test_memfit_accumulate_under_data_parallel_equals_keras():
    run_in_jax(__file__, "child_memfit_accumulate", devices=2)


def test_memfit_accumulate_under_data_parallel_with_sum_and_sample_weight_reductions():
    run_in_jax(__file__, "child_memfit_accumulate_reductions", devices=2)


def test_memfit_remat_under_data_parallel_equals_keras():
    run_in_jax(__file__, "child_memfit_remat", devices=2)


def test_memfit_shrink_under_data_parallel_one_update_per_piece():
    run_in_jax(__file__, "child_memfit_shrink", devices=2)


def test_steps_made_outside_the_distribution_are_not_reused_inside():
    run_in_jax(__file__, "child_steps_made_outside_the_distribution_are_not_reused_inside",
               devices=2)


def test_memfit_refuses_model_parallel_and_multi_process_with_a_clear_error():
    run_in_jax(__file__, "child_memfit_refuses_other_distributions", devices=2)



def test_real_oom_safe_predict_under_data_parallel_equals_keras_at_a_batch_that_fits():
    run_in_jax(__file__, "child_real_oom_predict", devices=2, address_space_gb=LIMIT_GB)
