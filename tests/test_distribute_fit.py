"""MemFit under `tf.distribute.MirroredStrategy`, on two logical CPU devices.

Fault injection (`two_devices`: one child process for the module, its CPU
split into `/CPU:0` and `/CPU:1`): the steps MemFit runs under the strategy
raise a real `ResourceExhaustedError` when the rows of ONE replica (replica
1) exceed a threshold, the other replica's rows never matter. Each MemFit run
is compared with plain Keras under the same strategy on the same data
(weights, optimizer variables, iterations, History, evaluate, predict).

Real OOMs (`test_fit_under_a_cap_*`): two fresh processes side by side, each
with two logical CPUs, one under TensorFlow's capped allocator with MemFit,
the other uncapped with plain `fit` (the reference, independent of
keras_memfit). The cap applies to the whole process: both logical CPUs share
one allocator, so it is sized for both replicas' activations. Each real OOM
costs about 20 s with two replicas.

Run directly, this file is the training script the real-OOM test starts:
`python tests/test_distribute_fit.py {memfit,plain} OUT_PREFIX`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = dict(rtol=1e-5, atol=1e-6)
CAP_MB = 280

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("tensorflow") is None
        or os.environ.get("KERAS_BACKEND", "tensorflow") != "tensorflow",
        reason="tf.distribute needs TensorFlow and Keras's TensorFlow backend",
    ),
]
if importlib.util.find_spec("keras") is not None:
    from support import requires_keras

    # Measured: Keras 3.8's own evaluate under MirroredStrategy gives
    # 0.462 / 0.508 / 0.525 for the same data at batch 32 / 16 / 8 (its metric
    # variables are ON_WRITE/SUM mirrors), 3.13 and 3.15 the same value at
    # every batch size; so before 3.13 no split-independent reference exists
    # for the metrics (MemFit's weights, optimizer variables and iterations
    # still equal Keras's there).
    pytestmark.append(requires_keras(
        (3, 13), "Keras's own metrics under MirroredStrategy depend on the batch size"
    ))


# ------------------------------------------------------------ in the child
def _strategy():
    import tensorflow as tf

    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    assert len(devices) == 2, devices  # the two_devices child
    return tf.distribute.MirroredStrategy(devices)


def _model(strategy, seed=3, optimizer="adam", custom=False, loss="mse"):
    """Dense(16, relu), Dense(2) under `strategy`; `custom`: with its own `train_step`."""
    import keras

    class OwnStep(keras.Sequential):
        def train_step(self, data):
            return super().train_step(data)

    keras.utils.set_random_seed(seed)
    with strategy.scope():
        layers = [
            keras.Input((6,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2)
        ]
        model = OwnStep(layers) if custom else keras.Sequential(layers)
        opt = (
            keras.optimizers.Adam(0.01) if optimizer == "adam"
            else keras.optimizers.SGD(0.05, momentum=0.9)
        )
        model.compile(optimizer=opt, loss=loss, metrics=["mae"])
    return model


def _data(n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype("float32")
    y = np.stack([x[:, :3].sum(1), x[:, 3:].prod(1)], axis=1).astype("float32")
    return x, y


class OneReplicaInjector:
    """OOMs from MemFit's replica steps when replica `replica` (default 1) holds more than `threshold` rows.

    `after=True` raises after the real micro-batch or test step ran (its
    metric updates happened: the guard must undo them). Records every call as
    (kind, rows per replica, raised).
    """

    def __init__(self, monkeypatch, strategy, threshold, after=False, replica=1):
        from keras_memfit._internal import cache as _cache
        from keras_memfit.backend.tensorflow import distribution

        self.calls = []
        self.strategy = strategy
        inject = self

        def wrap(kind, call):
            def wrapped(self_, data, *args):
                rows = inject.rows(data)
                over = rows[replica] > threshold
                # A train step that ran has applied its update: an OOM after
                # it is UPDATE_BEGAN, not retried; so "after" is for the
                # accumulator's micro-batches and the test step only.
                if over and (not after or kind == "train"):
                    inject.calls.append((kind, rows, True))
                    inject.raise_oom(rows[replica])
                result = call(self_, data, *args)
                inject.calls.append((kind, rows, over))
                if over:
                    inject.raise_oom(rows[replica])
                return result

            return wrapped

        monkeypatch.setattr(
            distribution.ReplicaTrainStep, "__call__",
            wrap("train", distribution.ReplicaTrainStep.__call__),
        )
        monkeypatch.setattr(
            distribution.ReplicaAccumulator, "add", wrap("add", distribution.ReplicaAccumulator.add)
        )
        make_test = distribution.Replicated._test_step

        def test_step(self_, model, exact):
            step = make_test(self_, model, exact)
            return lambda data: wrap("test", lambda _, d: step(d))(None, data)

        monkeypatch.setattr(distribution.Replicated, "_test_step", test_step)
        _cache.clear()

    def rows(self, data):
        import keras

        leaf = next(t for t in keras.tree.flatten(data) if t is not None)
        return [int(t.shape[0]) for t in self.strategy.experimental_local_results(leaf)]

    @staticmethod
    def raise_oom(rows):
        import tensorflow as tf

        raise tf.errors.ResourceExhaustedError(
            None, None, f"OOM when allocating tensor with shape[{rows},16] (injected)"
        )

    def of(self, kind):
        return [(rows, raised) for k, rows, raised in self.calls if k == kind]


def _assert_same_training(model, history, ref, ref_history):
    assert int(model.optimizer.iterations.numpy()) == int(ref.optimizer.iterations.numpy())
    for w, r in zip(model.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(w, r, **TOL)
    for v, r in zip(model.optimizer.variables, ref.optimizer.variables):
        np.testing.assert_allclose(np.array(v), np.array(r), **TOL, err_msg=v.path)
    for key, values in ref_history.history.items():
        np.testing.assert_allclose(history.history[key], values, **TOL, err_msg=key)


FIT = dict(batch_size=16, epochs=2, shuffle=False, verbose=0)


@pytest.mark.two_devices
@pytest.mark.parametrize("after", [False, True], ids=["before", "after-the-step-ran"])
def test_accumulate_on_one_replica_oom_equals_the_unsplit_fit(monkeypatch, after):
    """45 rows at 16: batches of 8+8 rows per replica, the last one 7+6.

    Replica 1 "runs out of memory" above 3 rows: every batch is accumulated
    from pieces on both replicas at once; validation batches (10+10) split
    too. Same weights, optimizer variables, iterations and History as plain
    Keras under the same strategy.
    """
    from keras_memfit import MemFit

    strategy = _strategy()
    x, y = _data(45)
    vx, vy = _data(40, seed=1)
    ref = _model(strategy)
    ref_history = ref.fit(x, y, validation_data=(vx, vy), validation_batch_size=20, **FIT)

    inject = OneReplicaInjector(monkeypatch, strategy, threshold=3, after=after)
    model = _model(strategy)
    memfit = MemFit()
    history = model.fit(
        x, y, validation_data=(vx, vy), validation_batch_size=20, callbacks=[memfit], **FIT
    )
    _assert_same_training(model, history, ref, ref_history)
    assert ref.optimizer.iterations.numpy() == 6  # 3 batches x 2 epochs: one step each

    adds = inject.of("add")
    assert adds and all(r[1] <= 3 for r, raised in adds if not raised)
    # The imbalanced last batch (7 + 6 rows) ran as pieces on both replicas.
    ok = [r for r, raised in adds if not raised]
    assert sum(r[0] for r in ok) == 2 * (8 + 8 + 7) and sum(r[1] for r in ok) == 2 * (8 + 8 + 6)
    assert any(r[0] != r[1] for r in ok)
    tests = inject.of("test")
    assert any(raised for _, raised in tests) and any(not raised for _, raised in tests)
    phases = {(e["phase"], e["kind"]) for e in memfit.events}
    assert ("train", "oom") in phases and ("evaluate", "oom") in phases
    assert history.history["memfit_split"][0] > 1


@pytest.mark.two_devices
@pytest.mark.parametrize("reduction", ["sum", "mean_with_sample_weight"])
def test_accumulate_weighs_each_replica_s_pieces_by_the_loss_reduction(monkeypatch, reduction):
    """As above, with a loss reduced with "sum" or "mean_with_sample_weight" and
    sample weights: each replica's micro-batches weighted within its own rows as
    the reduction says (1 each; their sample weights over the replica's)."""
    import keras

    from keras_memfit import MemFit

    strategy = _strategy()
    x, y = _data(45)
    weights = np.random.default_rng(2).uniform(0.2, 2.0, size=45).astype("float32")
    ref = _model(strategy, loss=keras.losses.MeanSquaredError(reduction=reduction))
    ref_history = ref.fit(x, y, sample_weight=weights, **FIT)
    OneReplicaInjector(monkeypatch, strategy, threshold=3)
    model = _model(strategy, loss=keras.losses.MeanSquaredError(reduction=reduction))
    history = model.fit(x, y, sample_weight=weights, callbacks=[MemFit()], **FIT)
    assert history.history["memfit_split"][0] > 1
    _assert_same_training(model, history, ref, ref_history)


@pytest.mark.two_devices
def test_a_replica_with_fewer_rows_than_pieces_runs_an_empty_piece(monkeypatch):
    """29 rows at 16: the last batch is 7 + 6 rows; pieces of one row on replica 1.

    The largest replica (7 rows) runs 7 pieces, so replica 1 (6 rows) runs
    one empty piece: the all-reduce lines up, and the update is still
    Keras's on the whole batch.
    """
    from keras_memfit import MemFit

    strategy = _strategy()
    x, y = _data(29)
    fit = dict(batch_size=16, epochs=1, shuffle=False, verbose=0)
    ref = _model(strategy)
    ref_history = ref.fit(x, y, **fit)
    inject = OneReplicaInjector(monkeypatch, strategy, threshold=1)
    model = _model(strategy)
    history = model.fit(x, y, callbacks=[MemFit()], **fit)
    _assert_same_training(model, history, ref, ref_history)
    ok = [r for r, raised in inject.of("add") if not raised]
    assert [1, 0] in ok and len(ok) == 8 + 7


@pytest.mark.two_devices
def test_one_device_strategy_accumulates_as_keras(monkeypatch):
    """`OneDeviceStrategy` (accepted as MirroredStrategy is): its one replica's batches
    of 16 accumulated from pieces of at most 5 rows, validation batches of 20 split
    too; the same training as plain Keras under the same strategy."""
    import tensorflow as tf

    from keras_memfit import MemFit

    strategy = tf.distribute.OneDeviceStrategy("/CPU:1")
    x, y = _data(45)
    vx, vy = _data(40, seed=1)
    ref = _model(strategy)
    ref_history = ref.fit(x, y, validation_data=(vx, vy), validation_batch_size=20, **FIT)

    inject = OneReplicaInjector(monkeypatch, strategy, threshold=5, replica=0)
    model = _model(strategy)
    history = model.fit(
        x, y, validation_data=(vx, vy), validation_batch_size=20, callbacks=[MemFit()], **FIT
    )
    _assert_same_training(model, history, ref, ref_history)
    adds = inject.of("add")
    assert any(raised for _, raised in adds), adds
    assert all(r[0] <= 5 for r, raised in adds if not raised), adds
    assert any(raised for _, raised in inject.of("test"))


@pytest.mark.two_devices
def test_a_batch_split_across_replicas_warns_as_on_one_device(monkeypatch, caplog):
    """The warning of a split batch (`batch_dependence.SplitWarnings`), as on one device:
    a model with Dropout names it once, when its first batch is accumulated on the replicas."""
    import logging

    import keras

    from keras_memfit import MemFit

    strategy = _strategy()
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((6,)), keras.layers.Dense(16), keras.layers.Dropout(0.3),
            keras.layers.Dense(2),
        ])
        model.compile(optimizer="adam", loss="mse")
    inject = OneReplicaInjector(monkeypatch, strategy, threshold=4)
    x, y = _data(48)
    with caplog.at_level(logging.WARNING, logger="keras_memfit"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[MemFit()])
    warned = [r.getMessage() for r in caplog.records
              if "depend on how a batch is split" in r.getMessage()]
    assert len(warned) == 1 and "dropout (Dropout)" in warned[0], warned
    assert len([r for r, raised in inject.of("add") if not raised]) == 3 * 2  # 3 batches, 2 pieces


@pytest.mark.two_devices
def test_no_oom_changes_nothing(monkeypatch):
    """With MemFit and nothing running out of memory: Keras's fit, with validation."""
    from keras_memfit import MemFit

    strategy = _strategy()
    x, y = _data(50)  # validation_split: the last 10 rows, 5 + 5 per replica
    ref = _model(strategy)
    ref_history = ref.fit(x, y, validation_split=0.2, **FIT)
    model = _model(strategy)
    memfit = MemFit()
    history = model.fit(x, y, validation_split=0.2, callbacks=[memfit], **FIT)
    _assert_same_training(model, history, ref, ref_history)
    assert memfit.events == [] and "memfit_split" not in history.history


@pytest.mark.two_devices
def test_recomputed_layers_train_as_keras(monkeypatch):
    """`MemFit(remat=[name])`: the layer recomputed on every replica, the same training."""
    from keras_memfit import MemFit
    from keras_memfit import backend

    module, made = backend.get(), []
    checkpoint = module.checkpoint
    monkeypatch.setattr(module, "checkpoint", lambda fn: made.append(fn) or checkpoint(fn))
    strategy = _strategy()
    x, y = _data(48)
    ref = _model(strategy)
    ref_history = ref.fit(x, y, **FIT)
    model = _model(strategy)
    history = model.fit(x, y, callbacks=[MemFit(remat=[model.layers[0].name])], **FIT)
    assert made, "no layer was recomputed"
    _assert_same_training(model, history, ref, ref_history)


@pytest.mark.two_devices
def test_evaluate_and_predict_with_memfit_equal_keras(monkeypatch):
    """`evaluate`/`predict` with `callbacks=[MemFit()]` under a strategy: Keras's results.

    Without an OOM and with one on replica 1 (batches of 24 rows: 12 + 12;
    Keras's own `evaluate` under the strategy fails on a batch that splits
    unevenly, so the reference batches split evenly).
    """
    from keras_memfit import MemFit

    strategy = _strategy()
    x, y = _data(48)
    model = _model(strategy)
    model.fit(x, y, **FIT)
    ref_eval = model.evaluate(x, y, batch_size=24, verbose=0, return_dict=True)
    ref_pred = model.predict(x, batch_size=24, verbose=0)

    got = model.evaluate(x, y, batch_size=24, verbose=0, return_dict=True, callbacks=[MemFit()])
    np.testing.assert_allclose(list(got.values()), list(ref_eval.values()), **TOL)
    np.testing.assert_allclose(model.predict(x, batch_size=24, verbose=0, callbacks=[MemFit()]),
                               ref_pred, **TOL)

    inject = OneReplicaInjector(monkeypatch, strategy, threshold=4, after=True)
    memfit = MemFit()
    got = model.evaluate(x, y, batch_size=24, verbose=0, return_dict=True, callbacks=[memfit])
    assert got.keys() == ref_eval.keys()
    np.testing.assert_allclose(list(got.values()), list(ref_eval.values()), **TOL)
    assert any(raised for _, raised in inject.of("test"))
    assert memfit.events and memfit.events[0]["phase"] == "evaluate"


@pytest.mark.two_devices
def test_predict_pieces_in_input_order(monkeypatch):
    """`predict` with MemFit, its batches split per replica: rows in the input's order."""
    import keras

    from keras_memfit import MemFit
    from keras_memfit._internal import cache as _cache
    from keras_memfit.backend.tensorflow import distribution

    strategy = _strategy()
    x, y = _data(45)
    model = _model(strategy)
    ref = model.predict(x, batch_size=23, verbose=0)
    make = distribution.Replicated._predict_step
    seen = []

    def predict_step(self_, model_):
        step = make(self_, model_)

        def run(data):
            leaf = keras.tree.flatten(data)[0]
            rows = [int(t.shape[0]) for t in strategy.experimental_local_results(leaf)]
            seen.append(rows)
            if rows[1] > 4:
                OneReplicaInjector.raise_oom(rows)
            return step(data)

        return run

    monkeypatch.setattr(distribution.Replicated, "_predict_step", predict_step)
    _cache.clear()  # a step compiled before the patch would bypass it
    memfit = MemFit()
    got = model.predict(x, batch_size=23, verbose=0, callbacks=[memfit])
    np.testing.assert_allclose(got, ref, **TOL)
    assert any(r[1] > 4 for r in seen) and memfit.events[0]["phase"] == "predict"


@pytest.mark.two_devices
@pytest.mark.parametrize("custom", [False, True], ids=["shrink", "custom-train-step"])
def test_shrink_runs_each_piece_as_one_optimizer_step_on_every_replica(monkeypatch, custom):
    """`mode="shrink"`: one optimizer step per piece; each replica the same number of pieces.

    A model with its own `train_step` trains this way under the default
    `MemFit()` (it cannot be accumulated), its step run by `strategy.run`.

    The reference: plain Keras under the same strategy, fed batches of 8
    (4 + 4 per replica) holding the rows of the pieces MemFit runs a batch of
    16 (8 + 8) as when replica 1 may hold at most 4 rows.
    """
    from keras_memfit import MemFit

    strategy = _strategy()
    x, y = _data(32)
    # A batch of 16 gives rows 0-7 to replica 0, 8-15 to replica 1; its
    # pieces are rows 0-3 + 8-11, then 4-7 + 12-15: Keras's batches of 8 in
    # that order.
    order = np.concatenate([b + np.array([0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15])
                            for b in (0, 16)])
    ref = _model(strategy, optimizer="sgd", custom=custom)
    ref_history = ref.fit(x[order], y[order], batch_size=8, epochs=1, shuffle=False, verbose=0)

    inject = OneReplicaInjector(monkeypatch, strategy, threshold=4)
    model = _model(strategy, optimizer="sgd", custom=custom)
    memfit = MemFit() if custom else MemFit(mode="shrink")
    history = model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0,
                        callbacks=[memfit])
    assert int(model.optimizer.iterations.numpy()) == 4  # 2 batches x 2 pieces
    for w, r in zip(model.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(w, r, **TOL)
    np.testing.assert_allclose(history.history["loss"], ref_history.history["loss"], **TOL)
    ran = [r for r, raised in inject.of("train") if not raised]
    assert ran == [[4, 4]] * 4


@pytest.mark.two_devices
def test_an_oom_once_the_update_began_is_final(monkeypatch):
    """An OOM after the replicas' optimizer update began: `OutOfMemoryError`, no retry.

    The step's update really ran (weights moved), then the call raised: the
    step tells `UPDATE_BEGAN`, and MemFit does not run the batch again.
    """
    import tensorflow as tf

    from keras_memfit import MemFit, OutOfMemoryError
    from keras_memfit._internal import cache as _cache
    from keras_memfit.backend.tensorflow import distribution

    strategy = _strategy()
    x, y = _data(32)
    model = _model(strategy)
    model.build((None, 6))
    before = [np.array(w) for w in model.get_weights()]
    make = distribution.ReplicaTrainStep.__init__

    def init(self, *args, **kwargs):
        make(self, *args, **kwargs)
        real = self._step

        def step(data):
            real(data)
            raise tf.errors.ResourceExhaustedError(None, None, "OOM (injected after the update)")

        self._step = step

    monkeypatch.setattr(distribution.ReplicaTrainStep, "__init__", init)
    _cache.clear()
    with pytest.raises(OutOfMemoryError, match="once the optimizer update of a step on 16 rows had begun") as info:
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[MemFit()])
    assert "keras_memfit.place" not in str(info.value)  # place refuses a strategy's model
    del info
    assert int(model.optimizer.iterations.numpy()) == 1  # ran once, not retried
    assert any(np.any(w != b) for w, b in zip(model.get_weights(), before))


@pytest.mark.two_devices
def test_unsupported_strategies_raise_clear_errors(monkeypatch):
    """MultiWorkerMirrored (keras-team/keras#20585), TPU and ParameterServer strategies."""
    import tensorflow as tf

    from keras_memfit import MemFit
    from keras_memfit.backend.tensorflow import distribution
    from keras_memfit.backend.tensorflow.distribution import check_strategy

    cases = [
        (tf.distribute.MultiWorkerMirroredStrategy, "keras-team/keras#20585"),
        (tf.distribute.TPUStrategy, "TPUStrategy"),
        (tf.distribute.experimental.ParameterServerStrategy, "ParameterServerStrategy"),
    ]
    for cls, words in cases:
        fake = object.__new__(cls)  # an instance, without starting a cluster
        with pytest.raises(NotImplementedError, match=words) as info:
            check_strategy(fake)
        assert f"Received: a model under {cls.__name__}" in str(info.value)
    check_strategy(_strategy())  # MirroredStrategy: no error

    # Through MemFit, at the start of fit and of a standalone evaluate.
    model = _model(_strategy())
    x, y = _data(16)
    fake = object.__new__(tf.distribute.MultiWorkerMirroredStrategy)
    monkeypatch.setattr(distribution, "active_strategy", lambda model: fake)
    for call in (model.fit, model.evaluate):
        with pytest.raises(NotImplementedError, match="keras-team/keras#20585"):
            call(x, y, batch_size=16, verbose=0, callbacks=[MemFit()])


# ------------------------------------------------------------- real OOMs
def _env(capped: bool) -> dict:
    from keras_memfit.app.env import capped_cpu_env

    env = {
        k: v for k, v in os.environ.items()
        if not k.startswith("TF_CPU_") and not k.startswith("KERAS_MEMFIT_TEST")
    }
    env.update(
        TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow",
        PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
    )
    if capped:
        env.update(capped_cpu_env(CAP_MB))
    return env


def test_fit_under_a_cap_equals_the_uncapped_fit(tmp_path):
    """Real OOMs on two replicas, in training and in validation.

    One epoch. The training batch of 1024 rows (512 per replica) does not
    fit under the cap and is accumulated; the last batch (77 rows) splits
    unevenly, 39 + 38; the validation batch of 1400 rows (700 per replica)
    does not fit and is split. The capped MemFit run trains like the
    uncapped plain run under the same strategy: weights, optimizer
    variables, iterations, History.
    """
    runs = {}
    try:
        for mode, capped in (("memfit", True), ("plain", False)):
            prefix = str(tmp_path / mode)
            runs[mode] = (subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), mode, prefix], cwd=ROOT,
                env=_env(capped), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            ), prefix)
        results = {}
        for mode, (proc, prefix) in runs.items():
            output, _ = proc.communicate(timeout=400)
            assert proc.returncode == 0, f"{mode} run failed:\n{output[-8000:]}"
            results[mode] = _load(prefix)
    finally:
        for proc, _ in runs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    got, ref = results["memfit"], results["plain"]
    assert got["replicas"] == ref["replicas"] == 2
    assert got["memory_limit_mb"] == CAP_MB and ref["memory_limit_mb"] is None
    ooms = [e for e in got["events"] if e["kind"] == "oom"]
    assert {e["phase"] for e in ooms} == {"train", "evaluate"}, got["events"]
    assert ref["iterations"] == got["iterations"] == 2
    for i, (w, r) in enumerate(zip(got["weights"], ref["weights"])):
        np.testing.assert_allclose(w, r, **TOL, err_msg=f"weight {i}")
    for i, (w, r) in enumerate(zip(got["optimizer"], ref["optimizer"])):
        np.testing.assert_allclose(w, r, **TOL, err_msg=f"optimizer variable {i}")
    for key, values in ref["history"].items():
        np.testing.assert_allclose(got["history"][key], values, **TOL, err_msg=key)
    assert max(float(np.max(np.abs(w - i))) for w, i in zip(ref["weights"], ref["initial"])) > 1e-3
    print("OOMs:", ooms, "fit seconds:", got["fit_seconds"], ref["fit_seconds"])


def _load(prefix):
    with open(prefix + ".json") as f:
        result = json.load(f)
    with np.load(prefix + ".npz") as arrays:
        for name in ("weights", "optimizer", "initial"):
            count = len([k for k in arrays.files if k.startswith(name[0] + "_")])
            result[name] = [arrays[f"{name[0]}_{i}"] for i in range(count)]
    return result


def _cnn_data(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.random((n, 28, 28, 1))
    y = (x.mean(axis=(1, 2, 3)) * 70).astype("int64") % 10
    return x, y


def _child(mode: str, prefix: str) -> None:
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras

    import keras_memfit
    from keras_memfit.backend import tensorflow as tf_backend

    limit = tf_backend.memory_limit("CPU:0")
    # Hidden from the planner, so that it tries each batch whole (and fails
    # for real) before splitting, as on a device whose limit is unknown.
    tf_backend.memory_limit = lambda device: None
    keras.config.set_floatx("float64")  # exact accumulation: see test_real_oom_fit.py
    strategy = tf.distribute.MirroredStrategy([d.name for d in tf.config.list_logical_devices("CPU")])
    keras.utils.set_random_seed(5)
    with strategy.scope():
        inputs = keras.Input((28, 28, 1))
        h = keras.layers.Conv2D(16, 3, activation="relu")(inputs)
        h = keras.layers.Conv2D(32, 3, activation="relu")(h)
        h = keras.layers.GlobalAveragePooling2D()(h)
        model = keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(h))
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    initial = [np.array(w) for w in model.get_weights()]
    x, y = _cnn_data(1101, seed=1)  # batches of 1024 and 77 (39 + 38)
    vx, vy = _cnn_data(1400, seed=2)
    memfit = keras_memfit.MemFit() if mode == "memfit" else None
    started = time.time()
    history = model.fit(
        x, y, batch_size=1024, epochs=1, shuffle=False, verbose=0,
        validation_data=(vx, vy), validation_batch_size=1400,
        callbacks=[memfit] if memfit else [],
    )
    result = {
        "replicas": strategy.num_replicas_in_sync,
        "iterations": int(model.optimizer.iterations.numpy()),
        "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
        "events": memfit.events if memfit else [],
        "memory_limit_mb": None if limit is None else limit[0] // 2**20,
        "fit_seconds": time.time() - started,
    }
    np.savez(
        prefix + ".npz",
        **{f"w_{i}": w for i, w in enumerate(model.get_weights())},
        **{f"o_{i}": np.array(v) for i, v in enumerate(model.optimizer.variables)},
        **{f"i_{i}": w for i, w in enumerate(initial)},
    )
    with open(prefix + ".json", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    _child(*sys.argv[1:3])
