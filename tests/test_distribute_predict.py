"""safe_predict and safe_evaluate on every replica of a tf.distribute.MirroredStrategy.

Every test here is marked `two_devices`: conftest.py runs the module's tests
in one subprocess whose CPU is split into two logical devices, the replicas
of `MirroredStrategy(["/CPU:0", "/CPU:1"])`. The `memory_cap` test runs in a
capped grandchild that keeps both logical CPUs; the cap is per process (both
replicas share one allocator), so it is sized for the two of them.

References are Keras's own `model.predict` / `model.evaluate` under the same
strategy at a batch that fits. Which replica ran a row is visible: the test
models output `tf.distribute`'s replica id per row, so a run whose pieces
are Keras's batches must give Keras's replica ids too. "One replica out of
memory" is injected inside the model on replica 1 only (a `tf.py_function`
raising `MemoryError`, which TensorFlow turns into a real
`ResourceExhaustedError` of the whole step), as one GPU filling up would.
"""

from __future__ import annotations

import logging
import re
import time

import keras
import numpy as np
import pytest

if keras.backend.backend() != "tensorflow":
    pytest.skip("tf.distribute needs the TensorFlow backend", allow_module_level=True)

import tensorflow as tf  # noqa: E402

import keras_memfit  # noqa: E402
from keras_memfit.planning import planner as planner_module  # noqa: E402
from keras_memfit.backend import tensorflow as tf_backend  # noqa: E402
from keras_memfit.placement import place  # noqa: E402

pytestmark = pytest.mark.two_devices

OOM_RE = re.compile(r"out of memory at batch_size=(\d+)")
TOL = dict(rtol=1e-5, atol=1e-6)


def strategy():
    return tf.distribute.MirroredStrategy(["/CPU:0", "/CPU:1"])


def ooms(caplog):
    """Batch sizes of the OOMs keras_memfit caught, in order."""
    return [
        int(m.group(1)) for r in caplog.records if r.name == "keras_memfit"
        for m in [OOM_RE.search(r.getMessage())] if m
    ]


class ReplicaId(keras.layers.Layer):
    """The id of the replica that ran each row (-1 outside `strategy.run`)."""

    def call(self, x):
        context = tf.distribute.get_replica_context()
        replica = context.replica_id_in_sync_group if context is not None else -1
        return tf.fill(tf.shape(x)[:1], tf.cast(replica, tf.int32))


class CallLog:
    """(replica, rows, failed) per call of a `FailOnReplica` (not a list: Keras copies those)."""

    def __init__(self):
        self.calls = []

    def failed(self):
        return [(replica, rows) for replica, rows, failed in self.calls if failed]

    def ran(self):
        return [(replica, rows) for replica, rows, failed in self.calls if not failed]


class FailOnReplica(keras.layers.Layer):
    """Identity; a real ResourceExhaustedError when replica 1's share has over `limit` rows.

    Every call is logged in a `CallLog`. The failing replica
    waits `delay` seconds first, so that replica 0 has finished its share
    (and updated its metrics) when the step fails.
    """

    def __init__(self, limit, log, delay=0.0, **kwargs):
        super().__init__(**kwargs)
        self.limit, self.log, self.delay = limit, log, delay

    def call(self, x):
        context = tf.distribute.get_replica_context()
        replica = context.replica_id_in_sync_group if context is not None else -1

        def check(rows, replica):
            rows, replica = int(rows), int(replica)
            failed = replica == 1 and self.limit is not None and rows > self.limit
            self.log.calls.append((replica, rows, failed))
            if failed:
                time.sleep(self.delay)
                raise MemoryError(f"injected: {rows} rows on replica 1")
            return np.int32(0)

        flag = tf.py_function(check, [tf.shape(x)[0], replica], tf.int32)
        with tf.control_dependencies([flag]):
            return tf.identity(x)


def replica_model(log=None, limit=None, delay=0.0):
    """Dense outputs "y" and the replica id per row "replica"; optionally failing on replica 1."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    h = FailOnReplica(limit, log if log is not None else CallLog(), delay)(inputs)
    h = keras.layers.Dense(8, activation="relu")(h)
    outputs = {"y": keras.layers.Dense(3)(h), "replica": ReplicaId()(inputs)}
    return keras.Model(inputs, outputs)


def data(n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.random((n, 6), dtype=np.float32), rng.random((n, 3), dtype=np.float32)


def compiled_model(log=None, limit=None, delay=0.0):
    """A model for evaluate: the dense output only, with a loss and two metrics."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    h = FailOnReplica(limit, log if log is not None else CallLog(), delay)(inputs)
    h = keras.layers.Dense(8, activation="relu")(h)
    model = keras.Model(inputs, keras.layers.Dense(3)(h))
    model.compile(loss="mse", metrics=["mae", keras.metrics.MeanSquaredError(name="mse2")])
    return model


def copies(variable):
    """Each replica's copy of a (distributed) Keras variable, as numpy."""
    return [np.asarray(c.numpy()) for c in variable.value.values]


# ------------------------------------------------------------------ predict
def test_safe_predict_runs_keras_batches_on_every_replica():
    """Arrays and a tf.data dataset (uneven last batch): Keras's outputs and replica ids."""
    mirrored = strategy()
    with mirrored.scope():
        model = replica_model()
    x, _ = data(37)
    reference = model.predict(x, batch_size=10, verbose=0)
    assert set(reference["replica"]) == {0, 1}  # Keras itself splits across both

    for given in (x, tf.data.Dataset.from_tensor_slices(x).batch(10)):
        got = keras_memfit.safe_predict(model, given, batch_size=10, verbose=0)
        np.testing.assert_allclose(got["y"], reference["y"], **TOL)
        # The same rows on the same replicas: 5/5 per batch, 4/3 for the last 7.
        np.testing.assert_array_equal(got["replica"], reference["replica"])


def test_safe_predict_inside_a_strategy_scope_on_a_model_built_outside():
    """Called inside `strategy.scope()`, as Keras's predict there: on every replica."""
    model = replica_model()
    x, _ = data(30, seed=1)
    with strategy().scope():
        reference = model.predict(x, batch_size=10, verbose=0)
        got = keras_memfit.safe_predict(model, x, batch_size=10, verbose=0)
    assert set(reference["replica"]) == {0, 1}
    np.testing.assert_allclose(got["y"], reference["y"], **TOL)
    np.testing.assert_array_equal(got["replica"], reference["replica"])
    # Outside the scope again: one device, as without a strategy.
    alone = keras_memfit.safe_predict(model, x, batch_size=10, verbose=0)
    np.testing.assert_allclose(alone["y"], reference["y"], **TOL)
    assert set(alone["replica"]) == {0}  # the default strategy's one replica


def test_safe_predict_out_of_memory_on_one_replica_splits_for_both(caplog):
    """Replica 1 fails above 5 rows: every piece shrinks until each share fits."""
    caplog.set_level(logging.WARNING, logger="keras_memfit")
    log = CallLog()
    mirrored = strategy()
    with mirrored.scope():
        model = replica_model(log, limit=5)
    x, _ = data(50, seed=2)
    reference = model.predict(x, batch_size=10, verbose=0)  # shares of 5 fit
    assert log.ran() and not log.failed()
    log.calls.clear()

    pieces = []
    recorder = keras.callbacks.LambdaCallback(
        on_predict_batch_end=lambda batch, logs: pieces.append(len(logs["y"]))
    )
    got = keras_memfit.safe_predict(model, x, batch_size=50, verbose=0, callbacks=[recorder])

    np.testing.assert_allclose(got["y"], reference["y"], **TOL)
    assert ooms(caplog) and ooms(caplog)[0] == 50, ooms(caplog)
    failed = log.failed()
    assert failed and {replica for replica, _ in failed} == {1}, log.calls
    assert all(rows > 5 for _, rows in failed)
    # Every attempt (failed or not) was split for both replicas, the larger
    # half first; replica 1 ran the smaller half of each piece kept.
    assert sum(pieces) == 50 and max(pieces) <= 10, pieces
    attempts = ooms(caplog) + pieces
    on_0 = sorted(rows for replica, rows in log.ran() if replica == 0)
    assert on_0 == sorted(-(-a // 2) for a in attempts), (log.calls, attempts)
    on_1 = sorted(rows for replica, rows in log.ran() if replica == 1)
    assert on_1 == sorted(p // 2 for p in pieces), (log.calls, pieces)
    assert max(on_1) <= 5


def test_safe_predict_sparse_input_is_shared_by_rows_too():
    """Keras batches sparse input; each batch is still cut into one share per replica."""
    scipy_sparse = pytest.importorskip("scipy.sparse")
    with strategy().scope():
        inputs = keras.Input((20,), sparse=True)
        model = keras.Model(inputs, keras.layers.Dense(3)(inputs))
    x = scipy_sparse.random(37, 20, density=0.2, format="csr", dtype="float32",
                            random_state=0)
    reference = model.predict(x, batch_size=10, verbose=0)
    got = keras_memfit.safe_predict(model, x, batch_size=10, verbose=0)
    np.testing.assert_allclose(got, reference, **TOL)


# ----------------------------------------------------------------- evaluate
def test_safe_evaluate_equals_keras_and_counts_on_every_replica():
    """Weighted and not; the metrics built under the strategy, one copy per replica."""
    mirrored = strategy()
    with mirrored.scope():
        model = compiled_model()
    x, y = data(37, seed=3)
    weights = np.random.default_rng(3).random(37).astype("float32") * 2

    # keras_memfit first: it builds the metrics (Keras builds them under the scope too).
    got = keras_memfit.safe_evaluate(model, x, y, batch_size=10, verbose=0, return_dict=True)
    count = next(v for v in model.metrics_variables if v.path.endswith("count"))
    assert len(copies(count)) == 2 and all(c > 0 for c in copies(count)), copies(count)
    got_weighted = keras_memfit.safe_evaluate(
        model, x, y, sample_weight=weights, batch_size=10, verbose=0, return_dict=True
    )

    expected = model.evaluate(x, y, batch_size=10, verbose=0, return_dict=True)
    expected_weighted = model.evaluate(
        x, y, sample_weight=weights, batch_size=10, verbose=0, return_dict=True
    )
    assert got.keys() == expected.keys()
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], rtol=1e-5, err_msg=key)
        np.testing.assert_allclose(
            got_weighted[key], expected_weighted[key], rtol=1e-5, err_msg=key
        )
    assert not np.isclose(got["loss"], got_weighted["loss"], rtol=1e-3)


def test_safe_evaluate_multi_output_losses_as_keras_counts_them_per_replica():
    """Per-output losses: Keras counts each replica's batch mean once; so does safe_evaluate."""
    with strategy().scope():
        a, b = keras.Input((3,), name="a"), keras.Input((2,), name="b")
        joined = keras.layers.Concatenate()([a, b])
        model = keras.Model({"a": a, "b": b},
                            {"p": keras.layers.Dense(2, name="p")(joined),
                             "q": keras.layers.Dense(1, name="q")(a)})
        model.compile(loss={"p": "mse", "q": "mae"}, metrics={"p": ["mae"]})
    rng = np.random.default_rng(7)
    x = {"a": rng.random((37, 3), dtype=np.float32), "b": rng.random((37, 2), dtype=np.float32)}
    y = {"p": rng.random((37, 2), dtype=np.float32), "q": rng.random((37, 1), dtype=np.float32)}
    got = keras_memfit.safe_evaluate(model, x, y, batch_size=10, verbose=0, return_dict=True)
    expected = model.evaluate(x, y, batch_size=10, verbose=0, return_dict=True)
    assert got.keys() == expected.keys() and "p_loss" in got
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], rtol=1e-5, err_msg=key)


@pytest.mark.parametrize("in_scope", [False, True], ids=["outside", "inside_scope"])
def test_safe_evaluate_out_of_memory_on_one_replica_counts_each_row_once(caplog, in_scope):
    """Replica 0 finished its share (metrics updated) when replica 1 failed: undone per replica."""
    caplog.set_level(logging.WARNING, logger="keras_memfit")
    log = CallLog()
    mirrored = strategy()
    with mirrored.scope():
        model = compiled_model(log, limit=5, delay=0.3)
    x, y = data(40, seed=4)
    expected = model.evaluate(x, y, batch_size=10, verbose=0, return_dict=True)
    # A first batch that fits, so the failed attempts have counts to restore.
    batches = tf.data.Dataset.from_tensor_slices((x[:10], y[:10])).batch(10).concatenate(
        tf.data.Dataset.from_tensor_slices((x[10:], y[10:])).batch(30)
    )

    if in_scope:
        with mirrored.scope():
            got = keras_memfit.safe_evaluate(model, batches, verbose=0, return_dict=True)
    else:
        got = keras_memfit.safe_evaluate(model, batches, verbose=0, return_dict=True)
    assert ooms(caplog) and ooms(caplog)[0] == 30, ooms(caplog)
    assert {replica for replica, _ in log.failed()} == {1}, log.calls
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], rtol=1e-5, err_msg=key)


# ------------------------------------------------------------------ planner
class TwoDevices:
    """A fake backend: two replica devices with their own memory, for the planner.

    `run(size)` splits a piece of `size` rows as the replicas do and raises
    each device's peak by its share times its bytes per row.
    """

    def __init__(self, limit, held, per_row):
        self.limit, self.held, self.per_row = limit, dict(held), dict(per_row)
        self.peak = dict(held)

    def replica_devices(self, model):
        return ("FAKE:0", "FAKE:1")

    def compute_device(self):
        return "FAKE:0"

    def memory_stats(self, device):
        return self.held[device], self.peak[device]

    def memory_limit(self, device):
        return self.limit, True

    def reset_peak(self, device):
        self.peak[device] = self.held[device]

    def run(self, size):
        shares = {"FAKE:0": -(-size // 2), "FAKE:1": size // 2}
        for device, share in shares.items():
            need = self.held[device] + share * self.per_row[device]
            self.peak[device] = max(self.peak[device], need)

    def __getattr__(self, name):
        return getattr(tf_backend, name)


def test_planner_sizes_pieces_for_the_fullest_replica_and_its_largest_peak(monkeypatch):
    """Budget: the smaller free memory (FAKE:1); growth: the larger (FAKE:1's rows cost more)."""
    mib = 1 << 20
    fake = TwoDevices(1000 * mib, {"FAKE:0": 100 * mib, "FAKE:1": 400 * mib},
                      {"FAKE:0": 1 * mib, "FAKE:1": 2 * mib})
    monkeypatch.setattr(planner_module._backend, "get", lambda: fake)

    class Model:
        name = "m"

    planner = planner_module.BatchPlanner(Model(), "predict", (("x",),), 100_000)
    assert planner.device == "FAKE:0, FAKE:1"
    while planner.next_size() in planner_module.PROBE_SIZES:  # the two probes
        size = planner.next_size()
        planner.started(size)
        fake.run(size)
        planner.succeeded(size, full=True)
    # By hand: FAKE:1 holds half of each piece at 2 MiB a row (1 MiB per row
    # of the piece) and has 600 MiB free; MARGIN of that.
    expected = int(600 * mib * planner_module.MARGIN // (1 * mib))
    assert planner.next_size() == expected
    fake.run(expected)  # both shares fit
    assert all(fake.peak[d] <= 1000 * mib for d in fake.peak)


# -------------------------------------------------------------------- place
def test_place_under_a_strategy_raises_a_clear_error():
    with strategy().scope():
        model = replica_model()
    with pytest.raises(NotImplementedError, match="distribution strategy.*'functional"):
        place(model, accelerator="/CPU:1")
    plain = replica_model()
    with strategy().scope(), pytest.raises(NotImplementedError, match="replica"):
        place(plain, accelerator="/CPU:1")


# --------------------------------------------------------------- real OOMs
CAP_MB = 300  # two replicas share the capped allocator
BIG = 2400  # ~0.23 MiB per row of the CNN: 1200 rows per replica cannot fit


def cnn():
    inputs = keras.Input((28, 28, 1))
    h = keras.layers.Conv2D(32, 3, activation="relu")(inputs)
    h = keras.layers.Conv2D(64, 3, activation="relu")(h)
    h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Flatten()(h)
    return keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(h))


@pytest.mark.memory_cap(CAP_MB)
def test_real_oom_two_replicas_predict_and_evaluate_equal_keras(caplog, monkeypatch):
    """A batch that runs out of memory on the replicas, split; results equal Keras's."""
    caplog.set_level(logging.WARNING, logger="keras_memfit")
    keras.utils.set_random_seed(5)
    mirrored = strategy()
    with mirrored.scope():
        model = cnn()
        model.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    x = np.random.default_rng(5).random((BIG, 28, 28, 1), dtype=np.float32)
    y = np.random.default_rng(6).integers(0, 10, size=BIG)
    reference = model.predict(x, batch_size=128, verbose=0)
    expected = model.evaluate(x, y, batch_size=128, verbose=0, return_dict=True)

    # The limit known: sized from the replicas' memory statistics, no OOM.
    got = keras_memfit.safe_predict(model, x, batch_size=BIG, verbose=0)
    np.testing.assert_allclose(got, reference, **TOL)
    assert ooms(caplog) == []

    # The limit hidden: the whole batch is tried and really runs out of memory.
    monkeypatch.setattr(tf_backend, "memory_limit", lambda device: None)
    keras_memfit.planning.planner.forget(model)
    got = keras_memfit.safe_predict(model, x, batch_size=BIG, verbose=0)
    np.testing.assert_allclose(got, reference, **TOL)
    # The whole batch in one piece (no probes first: the limit is unknown): a real try.
    assert 1 <= len(ooms(caplog)) <= 2 and ooms(caplog)[0] > BIG // 2, ooms(caplog)

    caplog.clear()
    result = keras_memfit.safe_evaluate(model, x, y, batch_size=BIG, verbose=0, return_dict=True)
    assert 1 <= len(ooms(caplog)) <= 2 and ooms(caplog)[0] > BIG // 2, ooms(caplog)
    for key in expected:
        np.testing.assert_allclose(result[key], expected[key], rtol=1e-5, err_msg=key)
