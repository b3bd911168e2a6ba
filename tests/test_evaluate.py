"""safe_evaluate against Keras's own `model.evaluate` on small batches.

Every expected value comes from an independent reference,
`model.evaluate(..., batch_size=7, verbose=0)`, never from keras_memfit. OOMs
are injected with the `inject_oom` fixture (conftest.py): compiled steps raise
a real `tf.errors.ResourceExhaustedError` for batches of more rows than a
threshold, either before the step ran or after it ran (metrics updated), which
the rollback must undo so that no sample is counted twice or lost.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import tensorflow as tf
import keras

from keras_memfit import OutOfMemoryError, safe_evaluate
from support import Batches, Recorder, oom_error_class, runtime_error, wrap_factory

REF_BATCH = 7
RTOL = 1e-5
N = 100
FEATURES = 6
CLASSES = 3


def _data(n=N, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, size=n)
    w = rng.uniform(0.1, 2.0, size=n).astype("float32")
    return x, y, w


def _binary(n=N, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype("float32")
    y = (x[:, :1] + 0.8 * rng.normal(size=(n, 1)) > 0).astype("float32")
    return x, y


def _classifier(metrics=("accuracy",), weighted_metrics=None, loss="sparse_categorical_crossentropy",
                units=CLASSES, activation="softmax"):
    keras.utils.set_random_seed(3)
    model = keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(8, activation="relu"),
        keras.layers.Dense(units, activation=activation),
    ])
    model.compile(optimizer="sgd", loss=loss, metrics=list(metrics) if metrics else None,
                  weighted_metrics=weighted_metrics)
    return model


def _close(actual, expected):
    if isinstance(expected, dict):
        assert isinstance(actual, dict)
        assert set(actual) == set(expected)
        for key in expected:
            np.testing.assert_allclose(actual[key], expected[key], rtol=RTOL, err_msg=key)
    elif isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected)
        np.testing.assert_allclose(actual, expected, rtol=RTOL)
    else:
        assert isinstance(actual, float)
        np.testing.assert_allclose(actual, expected, rtol=RTOL)


# --------------------------------------------------------------------------
# Return values without OOM
# --------------------------------------------------------------------------
def test_loss_only_returns_a_float():
    x, y, _ = _data()
    model = _classifier(metrics=None)
    expected = model.evaluate(x, y, batch_size=REF_BATCH, verbose=0)
    result = safe_evaluate(model, x, y, verbose=0)
    assert type(result) is float
    _close(result, expected)


def test_loss_and_accuracy_list_in_metrics_names_order():
    x, y, _ = _data()
    model = _classifier()
    expected = model.evaluate(x, y, batch_size=REF_BATCH, verbose=0)
    expected_dict = model.evaluate(x, y, batch_size=REF_BATCH, verbose=0, return_dict=True)
    result = safe_evaluate(model, x, y, batch_size=16, verbose=0)
    assert all(type(v) is float for v in result)
    _close(result, expected)
    np.testing.assert_allclose(result, [expected_dict["loss"], expected_dict["accuracy"]],
                               rtol=RTOL)


def test_return_dict():
    x, y, _ = _data()
    model = _classifier()
    expected = model.evaluate(x, y, batch_size=REF_BATCH, verbose=0, return_dict=True)
    result = safe_evaluate(model, x, y, verbose=0, return_dict=True)
    assert set(result) == {"loss", "accuracy"}
    assert all(type(v) is float for v in result.values())
    _close(result, expected)


def test_steps_limits_the_samples_as_keras_does():
    x, y, _ = _data()
    model = _classifier()
    expected = model.evaluate(x[:30], y[:30], batch_size=REF_BATCH, verbose=0, return_dict=True)
    result = safe_evaluate(model, x, y, batch_size=10, steps=3, verbose=0, return_dict=True)
    _close(result, expected)


def test_verbose_modes_give_the_same_results(capsys):
    x, y, _ = _data()
    model = _classifier()
    expected = model.evaluate(x, y, batch_size=REF_BATCH, verbose=0)
    capsys.readouterr()
    for verbose in (1, 2, "auto"):
        _close(safe_evaluate(model, x, y, verbose=verbose), expected)
    assert capsys.readouterr().out  # something was shown
    _close(safe_evaluate(model, x, y, verbose=0), expected)
    assert capsys.readouterr().out == ""


# --------------------------------------------------------------------------
# OOM injection: before the step, and after it (rollback)
# --------------------------------------------------------------------------
@pytest.mark.parametrize("after", [False, True], ids=["oom-before-step", "oom-after-step"])
def test_oom_gives_the_same_results(inject_oom, after):
    x, y, _ = _data()
    model = _classifier(metrics=["accuracy", "sparse_categorical_accuracy"])
    expected = model.evaluate(x, y, batch_size=REF_BATCH, verbose=0, return_dict=True)
    inject_oom(10, after=after)
    result = safe_evaluate(model, x, y, batch_size=32, verbose=0, return_dict=True)
    assert inject_oom.ooms(), "no OOM was injected"
    assert max(inject_oom.ok_rows()) <= 10
    assert sum(inject_oom.ok_rows()) == N  # every sample in exactly one piece
    _close(result, expected)


@pytest.mark.parametrize("after", [False, True], ids=["oom-before-step", "oom-after-step"])
def test_oom_on_a_fresh_model_gives_the_same_results(inject_oom, after):
    # No earlier evaluate has touched the metric variables.
    x, y, _ = _data()
    inject_oom(10, after=after)
    result = safe_evaluate(_classifier(), x, y, batch_size=32, verbose=0, return_dict=True)
    assert inject_oom.ooms()
    expected = _classifier().evaluate(x, y, batch_size=REF_BATCH, verbose=0, return_dict=True)
    _close(result, expected)


def test_first_batch_oom_does_not_bring_back_an_earlier_evaluation(inject_oom):
    # The metric variables still hold the totals of an evaluate on other data
    # when safe_evaluate starts; an OOM on its very first batch must not
    # restore them. One OOM only (64 fails, 32 fits; no growth in 100 samples).
    x, y, _ = _data()
    other_x, other_y, _ = _data(n=50, seed=9)
    expected = _classifier().evaluate(x, y, batch_size=REF_BATCH, verbose=0, return_dict=True)
    model = _classifier()
    model.evaluate(other_x, other_y, batch_size=REF_BATCH, verbose=0)
    inject_oom(50)
    result = safe_evaluate(model, x, y, batch_size=64, verbose=0, return_dict=True)
    assert inject_oom.ooms() == [64]
    _close(result, expected)


def test_oom_after_the_step_without_rollback_would_count_twice(inject_oom, monkeypatch):
    """Sanity check: the rollback tests above can fail."""
    x, y, _ = _data()
    model = _classifier()
    expected = model.evaluate(x, y, batch_size=REF_BATCH, verbose=0, return_dict=True)

    def no_rollback(guard):
        guard.restore = lambda: None
        return guard

    wrap_factory(monkeypatch, "guard_variables", no_rollback)
    inject_oom(10, after=True)
    result = safe_evaluate(model, x, y, batch_size=32, verbose=0, return_dict=True)
    assert not np.allclose(
        [result["loss"], result["accuracy"]], [expected["loss"], expected["accuracy"]],
        rtol=RTOL,
    )


@pytest.mark.parametrize("after", [False, True], ids=["oom-before-step", "oom-after-step"])
def test_stateful_metrics_survive_oom(inject_oom, after):
    x, y = _binary()
    model = _classifier(
        metrics=["accuracy", keras.metrics.AUC(name="auc"),
                 keras.metrics.Precision(name="precision"), keras.metrics.Recall(name="recall")],
        loss="binary_crossentropy", units=1, activation="sigmoid",
    )
    expected = model.evaluate(x, y, batch_size=REF_BATCH, verbose=0, return_dict=True)
    inject_oom(12, after=after)
    result = safe_evaluate(model, x, y, batch_size=64, verbose=0, return_dict=True)
    assert inject_oom.ooms()
    assert set(result) == {"loss", "accuracy", "auc", "precision", "recall"}
    _close(result, expected)


def test_sparse_categorical_and_top_k_metrics(inject_oom):
    x, y, _ = _data()
    model = _classifier(metrics=[
        keras.metrics.SparseCategoricalAccuracy(name="sca"),
        keras.metrics.SparseTopKCategoricalAccuracy(k=2, name="top2"),
        keras.metrics.SparseCategoricalCrossentropy(name="xent"),
    ])
    expected = model.evaluate(x, y, batch_size=REF_BATCH, verbose=0)
    inject_oom(9, after=True)
    result = safe_evaluate(model, x, y, batch_size=40, verbose=0)
    assert inject_oom.ooms()
    assert len(result) == 4
    _close(result, expected)


@pytest.mark.parametrize("after", [False, True], ids=["oom-before-step", "oom-after-step"])
def test_sample_weight_arrays(inject_oom, after):
    x, y, w = _data()
    model = _classifier(metrics=["sparse_categorical_accuracy"], weighted_metrics=["accuracy"])
    expected = model.evaluate(x, y, sample_weight=w, batch_size=REF_BATCH, verbose=0,
                              return_dict=True)
    unweighted = model.evaluate(x, y, batch_size=REF_BATCH, verbose=0, return_dict=True)
    assert not np.isclose(expected["accuracy"], unweighted["accuracy"], rtol=1e-3)
    inject_oom(10, after=after)
    result = safe_evaluate(model, x, y, sample_weight=w, batch_size=32, verbose=0,
                           return_dict=True)
    assert inject_oom.ooms()
    _close(result, expected)


def test_second_call_pays_no_oom_and_agrees(inject_oom):
    x, y, _ = _data()
    model = _classifier()
    expected = model.evaluate(x, y, batch_size=REF_BATCH, verbose=0)
    inject_oom(10, after=True)
    first = safe_evaluate(model, x, y, batch_size=32, verbose=0)
    assert inject_oom.ooms()
    inject_oom.calls.clear()
    second = safe_evaluate(model, x, y, batch_size=32, verbose=0)
    assert inject_oom.calls, "the second call ran no step"
    assert inject_oom.ooms() == []
    assert max(inject_oom.ok_rows()) <= 10
    _close(first, expected)
    _close(second, expected)


def test_same_data_as_a_tensor_pays_no_oom_again(inject_oom):
    # What fitted is remembered per input signature (shapes and dtypes); a
    # tf.Tensor and a numpy array of the same float32 data share it.
    x, y, _ = _data()
    model = _classifier()
    expected = model.evaluate(x, y, batch_size=REF_BATCH, verbose=0)
    inject_oom(10, after=True)
    safe_evaluate(model, x, y, batch_size=32, verbose=0)
    assert inject_oom.ooms()
    inject_oom.calls.clear()
    result = safe_evaluate(model, tf.constant(x), tf.constant(y), batch_size=32, verbose=0)
    assert inject_oom.ooms() == []
    _close(result, expected)


def test_repeated_calls_reset_the_metrics():
    x, y, _ = _data()
    x2, y2, _ = _data(n=60, seed=5)
    model = _classifier()
    expected = model.evaluate(x, y, batch_size=REF_BATCH, verbose=0)
    expected2 = model.evaluate(x2, y2, batch_size=REF_BATCH, verbose=0)
    first = safe_evaluate(model, x, y, verbose=0)
    other = safe_evaluate(model, x2, y2, verbose=0)
    again = safe_evaluate(model, x, y, verbose=0)
    _close(first, expected)
    _close(other, expected2)
    _close(again, expected)


def test_repeated_calls_with_oom_reset_the_metrics(inject_oom):
    x, y, _ = _data()
    model = _classifier()
    expected = model.evaluate(x, y, batch_size=REF_BATCH, verbose=0)
    inject_oom(10)
    results = [safe_evaluate(model, x, y, batch_size=32, verbose=0) for _ in range(3)]
    for result in results:
        _close(result, expected)


# --------------------------------------------------------------------------
# Other input kinds
# --------------------------------------------------------------------------
@pytest.mark.parametrize("after", [False, True], ids=["oom-before-step", "oom-after-step"])
def test_dataset_of_x_y(inject_oom, after):
    x, y, _ = _data()
    model = _classifier()
    expected = model.evaluate(x, y, batch_size=REF_BATCH, verbose=0, return_dict=True)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(30)
    inject_oom(10, after=after)
    result = safe_evaluate(model, ds, verbose=0, return_dict=True)
    assert inject_oom.ooms()
    assert sum(inject_oom.ok_rows()) == N
    _close(result, expected)


@pytest.mark.parametrize("after", [False, True], ids=["oom-before-step", "oom-after-step"])
def test_dataset_of_x_y_sample_weight(inject_oom, after):
    x, y, w = _data()
    model = _classifier(weighted_metrics=["accuracy"], metrics=None)
    expected = model.evaluate(x, y, sample_weight=w, batch_size=REF_BATCH, verbose=0,
                              return_dict=True)
    ds = tf.data.Dataset.from_tensor_slices((x, y, w)).batch(25)
    inject_oom(10, after=after)
    result = safe_evaluate(model, ds, verbose=0, return_dict=True)
    assert inject_oom.ooms()
    _close(result, expected)


def test_dataset_without_oom_and_with_steps():
    x, y, _ = _data()
    model = _classifier()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(20)
    _close(safe_evaluate(model, ds, verbose=0),
           model.evaluate(x, y, batch_size=REF_BATCH, verbose=0))
    _close(safe_evaluate(model, ds.repeat(), steps=2, verbose=0),
           model.evaluate(x[:40], y[:40], batch_size=REF_BATCH, verbose=0))


@pytest.mark.parametrize("after", [False, True], ids=["oom-before-step", "oom-after-step"])
def test_pydataset(inject_oom, after):
    x, y, _ = _data()
    model = _classifier()
    expected = model.evaluate(x, y, batch_size=REF_BATCH, verbose=0)
    inject_oom(10, after=after)
    result = safe_evaluate(model, Batches(x, y, batch_size=32), verbose=0)
    assert inject_oom.ooms()
    _close(result, expected)


def test_generator():
    x, y, _ = _data()
    model = _classifier()
    expected = model.evaluate(x, y, batch_size=REF_BATCH, verbose=0)
    gen = ((x[i:i + 16], y[i:i + 16]) for i in range(0, N, 16))
    _close(safe_evaluate(model, gen, verbose=0), expected)


def _two_input_model():
    keras.utils.set_random_seed(4)
    a = keras.Input((4,), name="a")
    b = keras.Input((2,), name="b")
    h = keras.layers.Concatenate()([keras.layers.Dense(5)(a), b])
    out = keras.layers.Dense(CLASSES, activation="softmax")(h)
    model = keras.Model({"a": a, "b": b}, out)
    model.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


@pytest.mark.parametrize("after", [False, True], ids=["oom-before-step", "oom-after-step"])
def test_dict_inputs(inject_oom, after):
    rng = np.random.default_rng(2)
    x = {"a": rng.normal(size=(N, 4)).astype("float32"),
         "b": rng.normal(size=(N, 2)).astype("float32")}
    y = rng.integers(0, CLASSES, size=N)
    model = _two_input_model()
    expected = model.evaluate(x, y, batch_size=REF_BATCH, verbose=0, return_dict=True)
    inject_oom(10, after=after)
    result = safe_evaluate(model, x, y, batch_size=32, verbose=0, return_dict=True)
    assert inject_oom.ooms()
    _close(result, expected)


# --------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------
def test_uncompiled_model_raises_naming_compile():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(2)])
    x, y, _ = _data()
    with pytest.raises(ValueError, match="compile"):
        safe_evaluate(model, x, y, verbose=0)


def test_not_a_model_raises_type_error():
    x, y, _ = _data()
    with pytest.raises(TypeError, match="keras.Model"):
        safe_evaluate(lambda v: v, x, y)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"batch_size": -3}, r"batch_size.*-3"),
        ({"batch_size": 0}, r"batch_size.*0"),
        ({"batch_size": 2.5}, r"batch_size.*2\.5"),
        ({"verbose": 7}, r"verbose.*7"),
        ({"verbose": "loud"}, r"verbose.*loud"),
        ({"steps": 0}, r"steps.*0"),
    ],
)
def test_bad_arguments_raise_naming_argument_and_value(kwargs, pattern):
    x, y, _ = _data()
    model = _classifier()
    with pytest.raises(ValueError, match=pattern):
        safe_evaluate(model, x, y, **kwargs)


def test_batch_size_with_a_dataset_is_ignored_as_keras_does(caplog):
    # model.evaluate ignores batch_size for a dataset (issue 12, item 4).
    x, y, _ = _data()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(10)
    model = _classifier()
    expected = model.evaluate(ds, batch_size=7, verbose=0)
    with caplog.at_level(logging.INFO, logger="keras_memfit"):
        result = safe_evaluate(model, ds, batch_size=7, verbose=0)
    np.testing.assert_allclose(result, expected, rtol=1e-5)
    assert any("batch_size=7 is ignored" in r.getMessage() for r in caplog.records)


def test_y_with_a_dataset_raises():
    x, y, _ = _data()
    ds = tf.data.Dataset.from_tensor_slices(x).batch(10)
    with pytest.raises(ValueError, match="y"):
        safe_evaluate(_classifier(), ds, y, verbose=0)


def test_missing_x_raises():
    with pytest.raises(ValueError, match="x"):
        safe_evaluate(_classifier(), None, verbose=0)


@pytest.mark.parametrize(
    "error",
    [
        runtime_error("Incompatible shapes"),
        runtime_error("cuDNN launch failure", status="INTERNAL"),
        RuntimeError("something unrelated to memory"),
    ],
    ids=["invalid-argument", "internal-not-oom", "runtime"],
)
def test_non_oom_errors_propagate_unchanged(monkeypatch, error):
    x, y, _ = _data()
    restores = []

    def counting_restores(guard):
        guard.restore = lambda: restores.append(1)
        return guard

    def failing(data):
        raise error

    wrap_factory(monkeypatch, "make_test_step", lambda step: failing)
    wrap_factory(monkeypatch, "guard_variables", counting_restores)
    with pytest.raises(type(error)) as info:
        safe_evaluate(_classifier(), x, y, verbose=0)
    assert info.value is error
    assert restores == []


def test_single_sample_oom_raises_out_of_memory_error(inject_oom):
    x, y, _ = _data()
    model = _classifier()
    inject_oom(0)
    with pytest.raises(OutOfMemoryError) as info:
        safe_evaluate(model, x, y, batch_size=8, verbose=0)
    err = info.value
    assert isinstance(err, oom_error_class())
    assert isinstance(err.__cause__, oom_error_class())
    assert err.phase == "evaluate"
    assert err.model_name == model.name
    assert err.batch_shape[0] == (1, FEATURES)
    assert inject_oom.ooms() == [8, 4, 2, 1]


# --------------------------------------------------------------------------
# Callbacks
# --------------------------------------------------------------------------
def test_callbacks_see_each_piece_and_the_final_logs(inject_oom):
    x, y, _ = _data()
    model = _classifier()
    expected = model.evaluate(x, y, batch_size=REF_BATCH, verbose=0, return_dict=True)
    inject_oom(10, after=True)
    recorder = Recorder()
    result = safe_evaluate(model, x, y, batch_size=32, verbose=0, return_dict=True,
                           callbacks=[recorder])
    hooks = recorder.hooks()
    assert hooks[0] == "test_begin" and hooks[-1] == "test_end"
    assert hooks.count("test_begin") == 1 and hooks.count("test_end") == 1
    ends = recorder.of("test_batch_end")
    pieces = inject_oom.ok_rows()
    assert len(ends) == len(pieces)
    assert [batch for batch, _ in ends] == list(range(len(pieces)))
    assert all(set(logs) == {"loss", "accuracy"} for _, logs in ends)
    _close(recorder.events[-1][2], expected)
    _close(result, expected)
    assert recorder.model is model


def test_callbacks_get_one_batch_begin_per_batch_end(inject_oom):
    """Keras pairs on_test_batch_begin/end; a failed attempt is not a batch."""
    x, y, _ = _data()
    inject_oom(10)
    recorder = Recorder()
    safe_evaluate(_classifier(), x, y, batch_size=32, verbose=0, callbacks=[recorder])
    begins = [batch for batch, _ in recorder.of("test_batch_begin")]
    ends = [batch for batch, _ in recorder.of("test_batch_end")]
    assert inject_oom.ooms()
    assert begins == ends


def test_callback_can_stop_evaluation():
    x, y, _ = _data()
    model = _classifier()
    expected = model.evaluate(x[:20], y[:20], batch_size=REF_BATCH, verbose=0)

    class StopAfterTwo(keras.callbacks.Callback):
        def on_test_batch_end(self, batch, logs=None):
            if batch == 1:
                self.model.stop_evaluating = True

    result = safe_evaluate(model, x, y, batch_size=10, verbose=0, callbacks=[StopAfterTwo()])
    _close(result, expected)


def test_repeated_calls_reuse_the_compiled_step(monkeypatch):
    x, y, _ = _data()
    model = _classifier()
    built = []
    wrap_factory(monkeypatch, "make_test_step", lambda step: built.append(1) or step)
    expected = model.evaluate(x, y, batch_size=REF_BATCH, verbose=0, return_dict=True)
    for _ in range(3):
        _close(safe_evaluate(model, x, y, batch_size=32, verbose=0, return_dict=True), expected)
    assert len(built) == 1
