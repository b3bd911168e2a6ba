"""`safe_predict`'s loop as `model.predict`'s: `steps`, `max_batch_size`, callbacks, verbosity."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from keras_memfit import safe_predict
from support import (
    Recorder,
    assert_same_result,
    dense_model,
    identity_model,
    random_data,
    reference,
    rows_data,
    rows_of,
)


# ---------------------------------------------------------------------------
# steps and max_batch_size
# ---------------------------------------------------------------------------
def test_steps_with_arrays(inject_oom):
    model = dense_model()
    x = random_data(100)
    inject_oom(None)
    result = safe_predict(model, x, batch_size=10, steps=3, verbose=0)
    expected = model.predict(x, batch_size=10, steps=3, verbose=0)
    assert expected.shape == (30, 3)
    assert_same_result(result, expected)
    assert sum(inject_oom.ok_rows()) == 30


def test_steps_with_arrays_under_oom(inject_oom):
    model = identity_model()
    x = rows_data(100)
    inject_oom(4)
    result = safe_predict(model, x, batch_size=10, steps=3, verbose=0)
    np.testing.assert_array_equal(result, x[:30])
    assert sum(inject_oom.ok_rows()) == 30


def test_steps_with_an_infinite_dataset(inject_oom):
    model = identity_model()
    x = rows_data(50)
    ds = tf.data.Dataset.from_tensor_slices(x).batch(20).repeat()
    inject_oom(8)
    result = safe_predict(model, ds, steps=4, verbose=0)
    expected = np.concatenate([x[:20], x[20:40], x[40:50], x[:20]])
    np.testing.assert_array_equal(result, expected)
    assert_same_result(result, model.predict(ds, steps=4, verbose=0))


def test_steps_with_dataset(inject_oom):
    model = dense_model()
    x = random_data(100)
    ds = tf.data.Dataset.from_tensor_slices(x).batch(30)
    inject_oom(12)
    result = safe_predict(model, ds, steps=2, verbose=0)
    expected = model.predict(ds, steps=2, verbose=0)
    assert expected.shape == (60, 3)
    assert_same_result(result, expected)
    assert sum(inject_oom.ok_rows()) == 60


def test_max_batch_size_bounds_every_piece_of_arrays(inject_oom):
    model = dense_model()
    x = random_data(500)
    inject_oom(None)
    result = safe_predict(model, x, batch_size=400, max_batch_size=45, verbose=0)
    assert_same_result(result, reference(model, x))
    assert inject_oom.calls
    assert all(rows <= 45 for rows in inject_oom.rows())
    assert sum(inject_oom.ok_rows()) == 500


def test_max_batch_size_bounds_every_piece_of_a_dataset(inject_oom):
    model = identity_model()
    x = rows_data(500)
    ds = tf.data.Dataset.from_tensor_slices(x).batch(200)
    inject_oom(None)
    result = safe_predict(model, ds, max_batch_size=45, verbose=0)
    np.testing.assert_array_equal(result, x)
    assert all(rows <= 45 for rows in inject_oom.rows())
    assert sum(inject_oom.ok_rows()) == 500


def test_max_batch_size_with_default_batch_size(inject_oom):
    model = dense_model()
    x = random_data(100)
    inject_oom(None)
    safe_predict(model, x, max_batch_size=10, verbose=0)
    assert inject_oom.ok_rows() == [10] * 10


# ---------------------------------------------------------------------------
# Callbacks and verbosity
# ---------------------------------------------------------------------------
def test_callbacks_receive_one_batch_end_per_piece(inject_oom):
    model = dense_model()
    x = random_data(400)
    recorder = Recorder()
    inject_oom(60)
    result = safe_predict(model, x, batch_size=300, callbacks=[recorder], verbose=0)
    assert_same_result(result, reference(model, x))
    hooks = recorder.hooks()
    assert hooks[0] == "predict_begin"
    assert hooks[-1] == "predict_end"
    batch_ends = recorder.of("predict_batch_end")
    assert [rows_of(logs["outputs"]) for _, logs in batch_ends] == inject_oom.ok_rows()
    assert [batch for batch, _ in batch_ends] == list(range(len(batch_ends)))
    assert inject_oom.ooms()  # the failed pieces got no batch_end
    assert recorder.model is model


def test_callback_batch_begin_and_end_are_paired(inject_oom):
    # Keras calls on_predict_batch_begin(i) then on_predict_batch_end(i) once
    # per batch; a retried piece must not send a second begin for batch i
    # (a timing or profiling callback would be thrown off).
    model = dense_model()
    x = random_data(200)
    recorder = Recorder()
    inject_oom(30)
    safe_predict(model, x, batch_size=100, callbacks=[recorder], verbose=0)
    assert inject_oom.ooms()
    begin, end = "predict_batch_begin", "predict_batch_end"
    log = [(hook, batch) for hook, batch, _ in recorder.events if hook in (begin, end)]
    ends = [batch for hook, batch in log if hook == end]
    expected = [entry for batch in ends for entry in ((begin, batch), (end, batch))]
    assert log == expected


def test_callback_can_stop_prediction(inject_oom):
    model = dense_model()
    x = random_data(100)

    class Stop(keras.callbacks.Callback):
        def on_predict_batch_end(self, batch, logs=None):
            if batch == 1:
                self.model.stop_predicting = True

    inject_oom(None)
    result = safe_predict(model, x, batch_size=20, callbacks=[Stop()], verbose=0)
    expected = reference(model, x)
    assert_same_result(result, expected[:40])


def test_verbose_1_prints_a_progress_bar(inject_oom, capsys):
    model = dense_model()
    x = random_data(120)
    inject_oom(None)
    capsys.readouterr()
    safe_predict(model, x, batch_size=50, verbose=1)
    out = capsys.readouterr().out
    assert "120/120" in out
    assert "━" in out  # Keras's progress bar


def test_verbose_1_under_oom_reaches_the_total(inject_oom, capsys):
    model = dense_model()
    inject_oom(30)
    capsys.readouterr()
    safe_predict(model, random_data(120), batch_size=100, verbose=1)
    assert "120/120" in capsys.readouterr().out
    assert inject_oom.ooms()


def test_verbose_auto_prints_a_progress_bar(inject_oom, capsys):
    model = dense_model()
    inject_oom(None)
    capsys.readouterr()
    safe_predict(model, random_data(70), batch_size=50)
    assert "70/70" in capsys.readouterr().out


def test_verbose_2_prints_one_line_at_the_end(inject_oom, capsys):
    model = dense_model()
    inject_oom(None)
    capsys.readouterr()
    safe_predict(model, random_data(70), batch_size=10, verbose=2)
    out = capsys.readouterr().out
    assert "70/70" in out
    assert "━" not in out


def test_verbose_0_prints_nothing(inject_oom, capsys):
    model = dense_model()
    inject_oom(40)
    capsys.readouterr()
    safe_predict(model, random_data(120), batch_size=100, verbose=0)
    assert capsys.readouterr().out == ""
    assert inject_oom.ooms()


def test_verbose_1_with_dataset_finishes_the_bar(inject_oom, capsys):
    model = dense_model()
    ds = tf.data.Dataset.from_tensor_slices(random_data(90)).batch(40)
    inject_oom(None)
    capsys.readouterr()
    safe_predict(model, ds, verbose=1)
    assert "90" in capsys.readouterr().out
