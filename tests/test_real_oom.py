"""Genuine out-of-memory errors, under a capped CPU allocator.

Every test here runs (through `@pytest.mark.memory_cap` in conftest.py) in a
fresh subprocess whose CPU device sits behind TensorFlow's BFC allocator capped
at a few hundred MiB, so an over-large batch fails with a real
`tf.errors.ResourceExhaustedError` raised by TensorFlow itself, not an
injected one. Each real OOM costs about ten seconds (the allocator waits for
memory before giving up), so the tests are few and each OOM is placed where it
proves something.

Every result is compared with an independent reference: `model.predict` /
`model.evaluate` at a small batch size that fits, in the same capped process.
OOMs are counted from keras_memfit's WARNING records ("out of memory at
batch_size=N").

Where a test needs an OOM at a chosen place (first, middle, last batch of a
dataset), it makes `memory_limit` report the allocator limit as unknown: with
the limit known the planner sizes batches from memory statistics before trying
them and usually pays no OOM at all (which the seed scenario checks); with it
unknown the planner (after two small probe pieces) tries each incoming batch
whole, so the big batch really runs out of memory and has to be split.
"""

from __future__ import annotations

import gc
import logging
import re

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

import keras_memfit  # noqa: E402
from keras_memfit.backend import tensorflow as tf_backend  # noqa: E402

CAP_MB = 200  # about 500 samples of the CNN below fit at predict time
# A batch of the CNN that cannot fit under CAP_MB (~0.23 MiB per sample), yet
# small enough that its pieces finish before the planner tries to grow back.
BIG = 2000
OOM_RE = re.compile(r"out of memory at batch_size=(\d+)")
TOL = dict(rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------- helpers
def cnn(name="cnn"):
    """The seed scenario's CNN: ~0.23-0.38 MiB per sample at predict time."""
    inputs = keras.Input((28, 28, 1))
    h = keras.layers.Conv2D(32, 3, activation="relu")(inputs)
    h = keras.layers.Conv2D(64, 3, activation="relu")(h)
    h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Flatten()(h)
    outputs = keras.layers.Dense(10, activation="softmax")(h)
    return keras.Model(inputs, outputs, name=name)


def images(n, seed=0):
    return np.random.default_rng(seed).random((n, 28, 28, 1), dtype=np.float32)


def batched(x, sizes):
    """A tf.data.Dataset yielding consecutive batches of `x` of the given sizes."""
    assert sum(sizes) == keras.tree.flatten(x)[0].shape[0]
    dataset, offset = None, 0
    for size in sizes:
        part = keras.tree.map_structure(lambda a: a[offset:offset + size], x)
        piece = tf.data.Dataset.from_tensor_slices(part).batch(size)
        dataset = piece if dataset is None else dataset.concatenate(piece)
        offset += size
    return dataset


def ooms(caplog):
    """Batch sizes of the OOMs keras_memfit caught, in order."""
    return [
        int(m.group(1))
        for record in caplog.records
        if record.name == "keras_memfit" and record.levelno == logging.WARNING
        for m in [OOM_RE.search(record.getMessage())]
        if m
    ]


def limit_unknown(monkeypatch):
    """Hide the allocator limit from the planner, so it tries batches whole.

    With TF_CPU_BFC_MEM_LIMIT_IN_MB visible the planner estimates a fitting
    size from two small probes before it tries a big batch, and no OOM
    happens; hiding it is how a test puts a real OOM on a batch of its choice.
    """
    monkeypatch.setattr(tf_backend, "memory_limit", lambda device: None)


class Timeline(keras.callbacks.Callback, logging.Handler):
    """Records, in order, each piece keras_memfit ran and each OOM it caught.

    Entries are ("piece", rows) from `on_predict_batch_end` and ("oom", rows)
    from keras_memfit's WARNING log records.
    """

    def __init__(self):
        keras.callbacks.Callback.__init__(self)
        logging.Handler.__init__(self, level=logging.WARNING)
        self.events = []

    def on_predict_batch_end(self, batch, logs=None):
        # Keras flattens {"outputs": {...}} into the output dict for callbacks.
        leaf = next(v for v in keras.tree.flatten(logs) if np.ndim(v))
        self.events.append(("piece", int(np.shape(leaf)[0])))

    def emit(self, record):
        match = OOM_RE.search(record.getMessage())
        if match:
            self.events.append(("oom", int(match.group(1))))

    def __enter__(self):
        logging.getLogger("keras_memfit").addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger("keras_memfit").removeHandler(self)

    def segments(self, sizes):
        """Split the events at the boundaries of input batches of `sizes`.

        Returns one list of events per input batch; an OOM belongs to the
        batch being worked on when it happened.
        """
        out, current, done, bounds = [], [], 0, list(np.cumsum(sizes))
        for kind, rows in self.events:
            current.append((kind, rows))
            if kind == "piece":
                done += rows
                if bounds and done == bounds[0]:
                    out.append(current)
                    current = []
                    bounds.pop(0)
                assert not bounds or done < bounds[0], (
                    f"a piece crossed an input batch boundary: {self.events}"
                )
        assert not current and not bounds, f"pieces do not cover the input: {self.events}"
        return out


def assert_labels_match(labels, probs):
    """`labels` are argmax of the reference `probs`, up to float near-ties."""
    labels = np.asarray(labels)
    assert labels.shape == probs.shape[:1]
    top2 = np.sort(probs, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 1e-5
    np.testing.assert_array_equal(labels[clear], probs.argmax(-1)[clear])
    # Where two classes tie within rounding, either is a correct argmax.
    chosen = probs[np.arange(len(labels)), labels]
    assert np.all(chosen >= probs.max(-1) - 1e-5)


# ------------------------------------------------------------------- tests
@pytest.mark.memory_cap(CAP_MB)
def test_seed_scenario_28000_samples_predicts_what_plain_predict_cannot(caplog):
    """model.predict(x, batch_size=28000) dies; safe_predict returns its answer."""
    caplog.set_level(logging.INFO, logger="keras_memfit")
    keras.utils.set_random_seed(0)
    model = cnn()
    x = images(28000)
    reference = model.predict(x, batch_size=128, verbose=0)

    with pytest.raises(tf.errors.ResourceExhaustedError):
        model.predict(x, batch_size=28000, verbose=0)
    gc.collect()  # the failed predict's buffers stay held until collected

    first = keras_memfit.safe_predict(model, x, batch_size=28000, verbose=0)
    first_ooms = ooms(caplog)
    assert first.shape == reference.shape and first.dtype == reference.dtype
    np.testing.assert_allclose(first, reference, **TOL)
    assert len(first_ooms) <= 2, first_ooms

    caplog.clear()
    second = keras_memfit.safe_predict(model, x, batch_size=28000, verbose=0)
    assert ooms(caplog) == []
    np.testing.assert_allclose(second, reference, **TOL)

    caplog.clear()
    labels = keras_memfit.safe_predict(
        model, x, batch_size=28000, verbose=0,
        postprocess=lambda y: keras.ops.argmax(y, axis=-1),
    )
    assert ooms(caplog) == []
    assert np.issubdtype(labels.dtype, np.integer)
    assert_labels_match(labels, reference)


@pytest.mark.memory_cap(CAP_MB)
def test_real_oom_on_first_and_middle_batch_of_a_dataset(caplog, monkeypatch):
    """The batch that runs out of memory is split; the others are untouched."""
    caplog.set_level(logging.WARNING, logger="keras_memfit")
    limit_unknown(monkeypatch)
    keras.utils.set_random_seed(1)
    model = cnn()
    cases = {"first": [BIG, 64, 64], "middle": [64, 64, BIG, 64]}
    x = images(max(sum(s) for s in cases.values()), seed=1)
    reference = model.predict(x, batch_size=128, verbose=0)

    for where, sizes in cases.items():
        # A fresh copy of the model: what the planner learned about the
        # original must not spare this case its OOM.
        fresh = cnn(name=f"cnn_{where}")
        fresh.set_weights(model.get_weights())
        n = sum(sizes)
        with Timeline() as timeline:
            got = keras_memfit.safe_predict(
                fresh, batched(x[:n], sizes), verbose=0, callbacks=[timeline]
            )
        assert got.shape == (n, 10), where
        np.testing.assert_allclose(got, reference[:n], **TOL, err_msg=where)

        big = sizes.index(BIG)
        per_batch = timeline.segments(sizes)
        for index, events in enumerate(per_batch):
            oom_rows = [rows for kind, rows in events if kind == "oom"]
            pieces = [rows for kind, rows in events if kind == "piece"]
            if index == big:
                assert 1 <= len(oom_rows) <= 3, (where, timeline.events)
                # A real attempt at (most of) the big batch, not a probe.
                assert oom_rows[0] > BIG // 2, (where, timeline.events)
                assert len(pieces) >= 2 and max(pieces) < oom_rows[0], (where, timeline.events)
            else:
                assert oom_rows == [], (where, index, timeline.events)
        assert len(ooms(caplog)) == sum(
            kind == "oom" for kind, _ in timeline.events
        )
        caplog.clear()


@pytest.mark.memory_cap(CAP_MB)
def test_real_oom_on_last_batch_with_dict_inputs_and_dict_outputs(monkeypatch, caplog):
    """Multi-input, multi-output model; the dataset's last batch runs out of memory."""
    caplog.set_level(logging.WARNING, logger="keras_memfit")
    limit_unknown(monkeypatch)
    keras.utils.set_random_seed(2)
    image = keras.Input((28, 28, 1), name="image")
    meta = keras.Input((3,), name="meta")
    h = keras.layers.Conv2D(32, 3, activation="relu")(image)
    h = keras.layers.Conv2D(64, 3, activation="relu")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    h = keras.layers.Concatenate()([h, meta])
    probs = keras.layers.Dense(5, activation="softmax", name="probs")(h)
    # Column 0 of `meta` is the sample's row number: an exact order check.
    row_id = keras.layers.Lambda(
        lambda m: keras.ops.cast(m[:, 0], "int32"), name="row_id"
    )(meta)
    model = keras.Model(
        {"image": image, "meta": meta}, {"probs": probs, "row_id": row_id}
    )

    sizes = [64, 64, 64, BIG]
    n = sum(sizes)
    rng = np.random.default_rng(2)
    x = {
        "image": images(n, seed=2),
        "meta": np.column_stack([np.arange(n), rng.random((n, 2))]).astype("float32"),
    }
    reference = model.predict(x, batch_size=128, verbose=0)
    assert reference["row_id"].dtype == np.int32  # the reference is what we think

    with Timeline() as timeline:
        got = keras_memfit.safe_predict(
            model, batched(x, sizes), verbose=0, callbacks=[timeline]
        )

    assert isinstance(got, dict) and set(got) == {"probs", "row_id"}
    for key in got:
        assert got[key].dtype == reference[key].dtype, key
        assert got[key].shape == reference[key].shape, key
    np.testing.assert_array_equal(got["row_id"], np.arange(n))
    np.testing.assert_allclose(got["probs"], reference["probs"], **TOL)

    *before, last = timeline.segments(sizes)
    assert all(kind == "piece" for events in before for kind, _ in events), timeline.events
    last_ooms = [rows for kind, rows in last if kind == "oom"]
    assert 1 <= len(last_ooms) <= 3 and last_ooms[0] == BIG, timeline.events
    assert ooms(caplog) == last_ooms


@pytest.mark.memory_cap(CAP_MB)
def test_safe_evaluate_under_real_oom_equals_small_batch_evaluate(monkeypatch, caplog):
    """Loss and accuracy, weighted and not, as model.evaluate at a batch that fits."""
    caplog.set_level(logging.WARNING, logger="keras_memfit")
    limit_unknown(monkeypatch)
    keras.utils.set_random_seed(3)
    model = cnn()
    model.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    n = BIG
    x = images(n, seed=3)
    rng = np.random.default_rng(3)
    y = rng.integers(0, 10, size=n)
    # Labels the model partly gets right, so accuracy is not just chance.
    y[: n // 3] = model.predict(x[: n // 3], batch_size=128, verbose=0).argmax(-1)
    weights = rng.random(n).astype("float32") * 3

    expected_weighted = model.evaluate(
        x, y, sample_weight=weights, batch_size=128, verbose=0, return_dict=True
    )
    expected = model.evaluate(x, y, batch_size=128, verbose=0, return_dict=True)
    assert expected["accuracy"] > 0.3
    assert not np.isclose(expected_weighted["loss"], expected["loss"], rtol=1e-3)

    weighted = keras_memfit.safe_evaluate(
        model, x, y, batch_size=n, sample_weight=weights, verbose=0, return_dict=True
    )
    assert 1 <= len(ooms(caplog)) <= 3, ooms(caplog)
    assert ooms(caplog)[0] > n // 2, ooms(caplog)  # a real try, not a probe
    assert set(weighted) == set(expected_weighted)
    for key, value in expected_weighted.items():
        np.testing.assert_allclose(weighted[key], value, rtol=1e-5, err_msg=key)

    caplog.clear()
    plain = keras_memfit.safe_evaluate(model, x, y, batch_size=n, verbose=0)
    assert ooms(caplog) == []
    np.testing.assert_allclose(
        plain, [expected["loss"], expected["accuracy"]], rtol=1e-5
    )


@pytest.mark.memory_cap(CAP_MB)
def test_one_sample_that_cannot_fit_raises_out_of_memory_error(caplog):
    """A single sample needing more than the cap: a clear, catchable error."""
    caplog.set_level(logging.WARNING, logger="keras_memfit")
    keras.utils.set_random_seed(4)
    inputs = keras.Input((None, None, 1))
    # 64x64 -> 4096x4096 -> 8 channels: ~0.5 GiB for one sample, few weights.
    h = keras.layers.UpSampling2D(64)(inputs)
    h = keras.layers.Conv2D(8, 3)(h)
    outputs = keras.layers.GlobalAveragePooling2D()(h)
    model = keras.Model(inputs, outputs, name="huge_activation")
    big = np.random.default_rng(4).random((1, 64, 64, 1), dtype=np.float32)
    small = np.random.default_rng(5).random((5, 3, 3, 1), dtype=np.float32)

    with pytest.raises(tf.errors.ResourceExhaustedError) as excinfo:
        keras_memfit.safe_predict(model, big, verbose=0)

    err = excinfo.value
    assert isinstance(err, keras_memfit.OutOfMemoryError)
    assert type(err.__cause__) is tf.errors.ResourceExhaustedError
    assert not isinstance(err.__cause__, keras_memfit.OutOfMemoryError)
    assert err.phase == "predict"
    assert err.model_name == "huge_activation"
    assert err.batch_shape == ((1, 64, 64, 1),)
    assert "huge_activation" in str(err) and "single sample" in str(err)
    assert ooms(caplog) == []  # nothing smaller than one sample to retry with
    del err, excinfo
    gc.collect()

    # The model, and keras_memfit, still work for an input that fits.
    reference = model.predict(small, batch_size=2, verbose=0)
    got = keras_memfit.safe_predict(model, small, verbose=0)
    np.testing.assert_allclose(got, reference, **TOL)
