"""The JAX backend: OOM forms, memory statistics, and results equal to plain Keras.

Each test runs its `child_*` function in a child process with Keras on JAX
(`tests/jax_support.py`); skipped where jax is not installed. References are
plain Keras on the same model and data; MemFit's splits are forced by making
the train step raise a constructed JAX OOM above a number of rows.
"""

from __future__ import annotations

import pickle

import numpy as np

from tests.jax_support import requires_jax, run_in_jax
from tests.support import assert_same_training

pytestmark = requires_jax

_ALLOC = "RESOURCE_EXHAUSTED: Out of memory allocating 6400000000 bytes."


def _model(outputs=3, seed=0):
    import keras

    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(outputs, activation="softmax")(hidden))
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def _data(rows=200, seed=1):
    rng = np.random.default_rng(seed)
    return (
        rng.normal(size=(rows, 6)).astype("float32"),
        rng.integers(0, 3, rows),
        rng.random(rows).astype("float32"),
    )


# ------------------------------------------------------------------ children
def child_oom_forms_real():
    """Under an address-space limit: a real allocation failure, and YNNPACK counted."""
    import jax
    import jax.numpy as jnp

    from keras_memfit import is_oom_error
    from keras_memfit.backend.jax import oom

    try:
        jnp.ones((40000, 40000)).block_until_ready()
    except jax.errors.JaxRuntimeError as err:
        real = err
    else:
        raise AssertionError("no OOM under the limit")
    assert "RESOURCE_EXHAUSTED: Out of memory allocating" in str(real), str(real)
    assert oom.is_allocation_oom(real) and is_oom_error(real)
    ynn = jax.errors.JaxRuntimeError("INTERNAL: YNNPACK operation failed: error")
    assert oom.is_ynnpack_oom_under_address_limit(ynn) and is_oom_error(ynn)
    assert jnp.ones(10).sum() == 10  # the process recovered


def child_oom_forms_constructed():
    import jax

    from keras_memfit import OutOfMemoryError, is_oom_error
    from keras_memfit.backend.jax import oom

    error = jax.errors.JaxRuntimeError
    gpu = error("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1024 bytes.")
    dispatch = error("INTERNAL: Error dispatching computation: Out of memory allocating 8 bytes.")
    tpu = error("RESOURCE_EXHAUSTED: Allocation (size=1073741824) would exceed memory (size=5)")
    legacy_class = type("XlaRuntimeError", (RuntimeError,), {"__module__": "jaxlib.xla_extension"})
    legacy = legacy_class(_ALLOC)
    assert oom.is_allocation_oom(gpu) and oom.is_allocation_oom(error(_ALLOC))
    assert oom.is_dispatch_oom(dispatch) and not oom.is_allocation_oom(dispatch)
    assert oom.is_tpu_allocation_oom(tpu)
    assert oom.is_jax_runtime_error(legacy) and oom.is_allocation_oom(legacy)
    for exc in (gpu, dispatch, tpu, legacy, error(_ALLOC)):
        assert is_oom_error(exc), exc
    ynn = error("INTERNAL: YNNPACK operation failed: error")
    assert not oom.is_ynnpack_oom_under_address_limit(ynn)  # no limit in this process
    for exc in (
        ynn,
        error("INTERNAL: Error dispatching computation: Invalid argument"),
        error("INVALID_ARGUMENT: shapes do not match"),
        error("RESOURCE_EXHAUSTED: too many open files"),
        RuntimeError("Allocation (size=4) would exceed memory"),
        ValueError("Out of memory allocating 8 bytes"),
        KeyboardInterrupt(),
    ):
        assert not is_oom_error(exc), exc
    assert issubclass(OutOfMemoryError, error)
    err = OutOfMemoryError("m", "predict", [(1, 6)], "cpu:0")
    assert "even with a batch of a single sample" in str(err)
    try:
        raise err
    except error as caught:  # existing `except jax.errors.JaxRuntimeError` still catch it
        assert caught is err
    copy = pickle.loads(pickle.dumps(err))
    assert type(copy) is OutOfMemoryError and str(copy) == str(err)


def child_memory_and_unsupported():
    import keras

    from keras_memfit import backend

    assert "jax" in backend.SUPPORTED
    jax_backend = backend.get()
    assert jax_backend.__name__ == "keras_memfit.backend.jax"
    device = jax_backend.compute_device()
    assert device == "cpu:0"
    assert jax_backend.memory_stats(device) is None  # JAX's CPU client gives none
    assert jax_backend.memory_limit(device) is None
    jax_backend.reset_peak(device)
    # memory_report runs on JAX (tests/test_jax_report.py); place does not yet.
    assert jax_backend.placement is None
    assert keras.backend.backend() == "jax"


def child_place_refuses_before_changing_anything():
    import keras
    import pytest

    import keras_memfit

    model = _model()
    call, add_weight = model.call, model.layers[1].add_weight
    with pytest.raises(NotImplementedError, match="not implemented for the jax backend"):
        keras_memfit.place(model, accelerator="cpu:1", cpu_layers=[model.layers[1].name])
    assert model.call == call and model.layers[1].add_weight == add_weight
    assert "call" not in model.__dict__ and "add_weight" not in model.layers[1].__dict__
    assert keras.backend.backend() == "jax"


def child_predict_and_evaluate_equal_keras():
    import keras

    import keras_memfit
    from keras_memfit import backend

    model = _model()
    x, y, w = _data()
    expected = model.predict(x, batch_size=64, verbose=0)
    np.testing.assert_allclose(
        keras_memfit.safe_predict(model, x, batch_size=64, verbose=0), expected, rtol=1e-6
    )
    labels = keras_memfit.safe_predict(
        model, x, batch_size=50, verbose=0, postprocess=lambda o: keras.ops.argmax(o, -1)
    )
    np.testing.assert_array_equal(labels, expected.argmax(-1))
    step = keras_memfit.inference.steps.predict_step(model)
    spec = backend.get().output_spec(step, x[:8])
    assert spec.shape == (None, 3) and spec.dtype == np.float32, spec
    for kwargs in ({}, {"sample_weight": w}):
        ref = model.evaluate(x, y, batch_size=64, verbose=0, return_dict=True, **kwargs)
        got = keras_memfit.safe_evaluate(
            model, x, y, batch_size=64, verbose=0, return_dict=True, **kwargs
        )
        assert set(got) == set(ref)
        for name in ref:
            np.testing.assert_allclose(got[name], ref[name], rtol=1e-6)


def _inject_train_oom(above):
    """Make keras_memfit's JAX train steps raise a JAX OOM on more than `above` rows."""
    import jax

    from keras_memfit.backend.jax import training

    calls = []

    def wrap(method):
        def wrapped(self, data, *args):
            rows = int(np.shape(keras_leaf(data))[0])
            calls.append(rows)
            if rows > above:
                raise jax.errors.JaxRuntimeError(_ALLOC)
            return method(self, data, *args)

        return wrapped

    training.TrainStep.__call__ = wrap(training.TrainStep.__call__)
    training.GradientAccumulator.add = wrap(training.GradientAccumulator.add)
    return calls


def keras_leaf(data):
    import keras

    return keras.tree.flatten(data)[0]


def child_memfit_accumulate_equals_keras():
    import keras

    import keras_memfit

    x, y, w = _data(240)
    for kwargs in ({}, {"sample_weight": w}, {"class_weight": {0: 1.0, 1: 2.0, 2: 0.5}}):
        reference = _model()
        expected = reference.fit(
            x, y, batch_size=120, epochs=2, shuffle=False, verbose=0, **kwargs
        ).history
        model = _model()
        calls = _inject_train_oom(above=50)
        memfit = keras_memfit.MemFit()
        history = model.fit(
            x, y, batch_size=120, epochs=2, shuffle=False, verbose=0,
            callbacks=[memfit], **kwargs,
        ).history
        assert max(calls) == 120 and any(rows <= 50 for rows in calls)
        assert history["memfit_split"][0] > 1 and history["memfit_ooms"][0] >= 1
        assert_same_training(model, history, reference, expected, iterations=4)
        from keras_memfit.backend.jax import training

        import importlib

        importlib.reload(training)  # undo the injection for the next case
        keras.backend.clear_session()


def child_memfit_shrink_and_validation():
    import keras_memfit

    x, y, _ = _data(240)
    model = _model()
    calls = _inject_train_oom(above=50)
    history = model.fit(
        x, y, batch_size=120, epochs=1, shuffle=False, verbose=0,
        validation_data=(x[:100], y[:100]), callbacks=[keras_memfit.MemFit(mode="shrink")],
    ).history
    assert any(rows <= 50 for rows in calls)
    assert int(model.optimizer.iterations.value) > 2  # one step per piece
    reference = model.evaluate(x[:100], y[:100], verbose=0, return_dict=True)
    np.testing.assert_allclose(history["val_loss"][0], reference["loss"], rtol=1e-5)


def child_data_parallel_two_devices():
    """Under keras.distribution.DataParallel on two host devices: results equal
    plain Keras (MemFit under it: tests/test_jax_distribution.py)."""
    import jax
    import keras

    import keras_memfit

    assert len(jax.devices()) == 2
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    model = _model()
    x, y, _ = _data(256)
    expected = model.predict(x, batch_size=64, verbose=0)
    np.testing.assert_allclose(
        keras_memfit.safe_predict(model, x, batch_size=64, verbose=0), expected, rtol=1e-6
    )
    ref = model.evaluate(x, y, batch_size=64, verbose=0, return_dict=True)
    got = keras_memfit.safe_evaluate(model, x, y, batch_size=64, verbose=0, return_dict=True)
    for name in ref:
        np.testing.assert_allclose(got[name], ref[name], rtol=1e-6)


# --------------------------------------------------------------------- tests
def test_a_real_allocation_failure_is_an_oom_and_the_process_recovers():
    run_in_jax(__file__, "child_oom_forms_real", address_space_gb=3)


def test_jax_oom_forms_and_out_of_memory_error():
    run_in_jax(__file__, "child_oom_forms_constructed")


def test_memory_statistics_on_cpu_and_unsupported_parts_say_so():
    run_in_jax(__file__, "child_memory_and_unsupported")


def test_place_refuses_on_jax_before_changing_anything():
    run_in_jax(__file__, "child_place_refuses_before_changing_anything", devices=2)


def test_safe_predict_and_safe_evaluate_equal_keras_on_jax():
    run_in_jax(__file__, "child_predict_and_evaluate_equal_keras")


def test_memfit_accumulate_equals_the_unsplit_fit_on_jax():
    run_in_jax(__file__, "child_memfit_accumulate_equals_keras")


def test_memfit_shrink_and_validation_on_jax():
    run_in_jax(__file__, "child_memfit_shrink_and_validation")


def test_data_parallel_on_two_host_devices_equals_keras():
    run_in_jax(__file__, "child_data_parallel_two_devices", devices=2)
