"""Tests of keras_memfit.place with /CPU:1 standing in for the accelerator.

Every test here is marked `two_devices`: conftest.py runs the module's tests
in one subprocess whose CPU is split into two logical devices, so the
variables, the optimizer slots and the ops of the traced functions can be
checked against the devices the plan names. The reference for outputs and
training is the same model, unplaced, with the same weights.
"""

from __future__ import annotations

import logging

import keras
import numpy as np
import pytest

from keras_memfit import placement
from keras_memfit.placement import PlacementPlan, place

pytestmark = pytest.mark.two_devices

HOST, ACC = "/CPU:0", "/CPU:1"
ROWS, DIM, SEQ, FILTERS, CLASSES = 200_000, 16, 8, 32, 4
TABLE_BYTES = ROWS * DIM * 4
# Conv1D(32, 3) on 16 channels + Dense(4) on 32: hand-counted parameters.
REST_PARAMS = (3 * DIM * FILTERS + FILTERS) + (FILTERS * CLASSES + CLASSES)
CUT_BYTES = SEQ * DIM * 4  # the embedding's output, per sample


def _device(variable) -> str:
    return "/CPU:" + variable.value.device.rsplit(":", 1)[-1]


def _sequential(with_input=True):
    layers = [
        keras.layers.Embedding(ROWS, DIM, name="emb"),
        keras.layers.Conv1D(FILTERS, 3, name="conv"),
        keras.layers.GlobalAveragePooling1D(name="pool"),
        keras.layers.Dense(CLASSES, name="head"),
    ]
    if with_input:
        layers.insert(0, keras.Input((SEQ,), dtype="int32"))
    return keras.Sequential(layers)


def _functional():
    ids = keras.Input((SEQ,), dtype="int32")
    h = keras.layers.Embedding(ROWS, DIM, name="emb")(ids)
    h = keras.layers.Conv1D(FILTERS, 3, name="conv")(h)
    h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    return keras.Model(ids, keras.layers.Dense(CLASSES, name="head")(h))


class Subclassed(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.emb = keras.layers.Embedding(ROWS, DIM, name="emb")
        self.conv = keras.layers.Conv1D(FILTERS, 3, name="conv")
        self.pool = keras.layers.GlobalAveragePooling1D(name="pool")
        self.head = keras.layers.Dense(CLASSES, name="head")

    def call(self, x):
        return self.head(self.pool(self.conv(self.emb(x))))


def _subclassed(built=True):
    model = Subclassed()
    if built:  # Keras's build() would not build the sublayers of a subclassed model
        model(np.zeros((1, SEQ), "int32"))
    return model


BUILDERS = {"sequential": _sequential, "functional": _functional, "subclassed": _subclassed}


def _compile(model):
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _data(n=32, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, ROWS, (n, SEQ)).astype("int32"), rng.integers(0, CLASSES, (n,))


def _pair(kind):
    """A model and an unplaced twin with the same weights, both compiled."""
    keras.utils.set_random_seed(1)
    model, ref = BUILDERS[kind](), BUILDERS[kind]()
    ref.set_weights(model.get_weights())
    return _compile(model), _compile(ref)


def _crossings(graph):
    """Tensors made on one requested device and consumed on another."""
    found = {}
    for op in graph.get_operations():
        if not op.device:
            continue
        for t in op.inputs:
            if t.op.device and t.op.device != op.device:
                found[t.name] = (t.op.device, op.device, t.shape.as_list())
    return found


# ---------------------------------------------------------------- choice
def test_budget_below_the_table_pins_the_embedding_and_only_the_cut_crosses():
    model = _compile(_sequential())
    plan = place(model, budget=10_000_000, accelerator=ACC)
    assert isinstance(plan, PlacementPlan)
    assert plan.applied and plan.cpu_layers == ["emb"]
    assert (plan.host, plan.accelerator) == (HOST, ACC)
    # weights + Adam's two slots, hand-computed
    assert plan.device_bytes == {HOST: 3 * TABLE_BYTES, ACC: 3 * 4 * REST_PARAMS}
    assert plan.crossing_bytes_per_sample == CUT_BYTES
    assert "emb" in plan.reason
    devices = {v.path: _device(v) for v in model.weights}
    assert devices == {
        "sequential/emb/embeddings": HOST, "sequential/conv/kernel": ACC,
        "sequential/conv/bias": ACC, "sequential/head/kernel": ACC,
        "sequential/head/bias": ACC,
    } or all(d == (HOST if "emb" in p else ACC) for p, d in devices.items())


def test_budget_that_fits_pins_nothing_and_names_why():
    model = _compile(_sequential())
    plan = place(model, budget=1 << 30, accelerator=ACC)
    assert plan.cpu_layers == [] and not plan.applied
    assert plan.device_bytes == {ACC: 3 * (TABLE_BYTES + 4 * REST_PARAMS)}
    assert plan.crossing_bytes_per_sample == 0
    assert "fit" in plan.reason
    assert all(_device(v) == ACC for v in model.weights)


def test_wide_dense_on_raw_features_is_pinned_but_a_conv_never_is():
    keras.utils.set_random_seed(0)
    x = keras.Input((5000,))
    h = keras.layers.Dense(64, name="wide")(x)  # 320k weights, used once per sample
    h = keras.layers.Reshape((16, 4))(h)
    h = keras.layers.Conv1D(512, 3, name="conv")(h)  # 6.7k weights, each used 14 times
    h = keras.layers.GlobalAveragePooling1D()(h)
    model = keras.Model(x, keras.layers.Dense(2, name="head")(h))
    plan = place(model, budget=40_000, accelerator=ACC)  # no optimizer: weights only
    assert plan.cpu_layers == ["wide"]
    assert plan.device_bytes[ACC] == (3 * 4 * 512 + 512 + 512 * 2 + 2) * 4
    assert plan.crossing_bytes_per_sample == 64 * 4
    assert plan.device_bytes[HOST] == (5000 * 64 + 64) * 4
    assert "still leaves" in plan.reason  # the conv alone exceeds half the budget


def test_unknown_device_limit_pins_only_oversized_cheap_layers(monkeypatch):
    model = _sequential()
    monkeypatch.setattr(placement, "OVERSIZED_BYTES", TABLE_BYTES)
    plan = place(model, accelerator=ACC)
    assert plan.cpu_layers == ["emb"]
    monkeypatch.setattr(placement, "OVERSIZED_BYTES", TABLE_BYTES + 1)
    plan = place(model, accelerator=ACC)
    assert plan.cpu_layers == []
    assert _device(model.get_layer("emb").embeddings) == ACC  # replaced placement
    assert "call" not in model.get_layer("emb").__dict__  # its host wrapper is gone


# ----------------------------------------------- equality with the unplaced model
@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_outputs_and_three_training_steps_equal_the_unplaced_model(kind):
    model, ref = _pair(kind)
    plan = place(model, cpu_layers=["emb"], accelerator=ACC)
    assert plan.cpu_layers == ["emb"] and plan.applied
    assert plan.crossing_bytes_per_sample == CUT_BYTES
    x, _ = _data()
    np.testing.assert_allclose(model.predict(x, verbose=0), ref.predict(x, verbose=0),
                               rtol=1e-6, atol=1e-6)
    for step in range(3):
        xs, ys = _data(seed=step + 1)
        loss = model.train_on_batch(xs, ys)
        ref_loss = ref.train_on_batch(xs, ys)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for got, want in zip(model.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    emb = model.get_layer("emb").embeddings
    assert _device(emb) == HOST
    assert all(_device(v) == ACC for v in model.weights if v is not emb)
    # Adam's moments follow their variable.
    slots = [v for v in model.optimizer.variables if len(v.shape) >= 1]
    assert len(slots) == 2 * len(model.trainable_weights)
    for slot in slots:
        assert _device(slot) == (HOST if "emb" in slot.path else ACC), slot.path


def test_slots_of_an_optimizer_built_before_place_are_moved():
    model, _ = _pair("functional")
    x, y = _data()
    model.train_on_batch(x, y)  # builds Adam with every slot on the default /CPU:0
    assert _device(model.optimizer.variables[-1]) == HOST
    before = [v.numpy().copy() for v in model.optimizer.variables]
    place(model, cpu_layers=["emb"], accelerator=ACC)
    for slot, value in zip(model.optimizer.variables, before):
        np.testing.assert_array_equal(slot.numpy(), value)
        if len(slot.shape):
            assert _device(slot) == (HOST if "emb" in slot.path else ACC), slot.path


@pytest.mark.parametrize("kind", ["sequential", "subclassed"])
def test_place_before_build_creates_variables_where_they_belong(kind):
    model = _sequential(with_input=False) if kind == "sequential" else _subclassed(built=False)
    assert not model.built
    place(model, cpu_layers=["emb"], accelerator=ACC)
    _compile(model)
    x, y = _data()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    for v in model.weights + [s for s in model.optimizer.variables if len(s.shape)]:
        assert _device(v) == (HOST if "emb" in v.path else ACC), v.path


# ---------------------------------------------------------- traced functions
def test_ops_of_traced_predict_and_train_functions_run_where_planned():
    import tensorflow as tf

    model = _compile(_functional())
    place(model, cpu_layers=["emb"], accelerator=ACC)
    x, y = _data()
    model.train_on_batch(x, y)
    x_spec = tf.TensorSpec([None, SEQ], tf.int32)
    graphs = {
        "predict": tf.function(model.predict_step).get_concrete_function((x_spec,)).graph,
        "train": tf.function(model.train_step).get_concrete_function(
            (x_spec, tf.TensorSpec([None], tf.int64))).graph,
    }
    for name, graph in graphs.items():
        ops = graph.get_operations()
        gathers = [op for op in ops if "Gather" in op.type and "gradient" not in op.name]
        heavy = [op for op in ops if op.type in ("Conv2D", "MatMul") and "gradient" not in op.name]
        assert gathers and all(op.device.endswith("CPU:0") for op in gathers), name
        assert heavy and all(op.device.endswith("CPU:1") for op in heavy), name
        crossing = _crossings(graph)
        # Only the embedding's output crosses, host -> accelerator.
        assert len(crossing) == 1, (name, crossing)
        (src, dst, shape), = crossing.values()
        assert (src[-5:], dst[-5:], shape) == ("CPU:0", "CPU:1", [None, SEQ, DIM]), name
    train_ops = graphs["train"].get_operations()
    # The embedding's backward pass runs on the host too (not where the tape is).
    emb_grads = [op for op in train_ops if "gradient" in op.name and "/emb" in op.name
                 and op.type not in ("Const", "NoOp")]
    assert emb_grads and all(op.device.endswith("CPU:0") for op in emb_grads)
    # Adam updates run on their variable's device: m, v and the table on the host,
    # m, v and the weight of each of the 4 accelerator variables there.
    updates = [op.device[-5:] for op in train_ops
               if op.name.split("/")[0].startswith("adam") and op.type.startswith("Assign")
               and op.device]
    assert sorted(updates) == ["CPU:0"] * 3 + ["CPU:1"] * 12


def test_a_pinned_dense_computes_its_kernel_gradient_on_the_host():
    import tensorflow as tf

    def build():
        x = keras.Input((300,))
        h = keras.layers.Dense(32, name="wide")(x)
        model = keras.Model(x, keras.layers.Dense(1, name="head")(keras.layers.ReLU()(h)))
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return model

    keras.utils.set_random_seed(3)
    model, ref = build(), build()
    ref.set_weights(model.get_weights())
    place(model, cpu_layers=["wide"], accelerator=ACC)
    rng = np.random.default_rng(0)
    for _ in range(2):
        x, y = rng.standard_normal((16, 300), "float32"), rng.standard_normal((16, 1), "float32")
        np.testing.assert_allclose(model.train_on_batch(x, y), ref.train_on_batch(x, y), rtol=1e-5)
    for got, want in zip(model.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    graph = tf.function(model.train_step).get_concrete_function(
        (tf.TensorSpec([None, 300]), tf.TensorSpec([None, 1]))).graph
    grads = [op for op in graph.get_operations()
             if op.type in ("MatMul", "BiasAddGrad") and "gradient" in op.name]
    wide = [op.device[-5:] for op in grads if "/wide" in op.name]
    # the kernel's and the input's MatMul and the bias's BiasAddGrad, all on the host
    assert sorted(wide) == ["CPU:0"] * 3, [(op.name, op.device) for op in grads]


def test_memfit_micro_batches_and_safe_predict_work_on_a_placed_model(inject_oom):
    from keras_memfit import MemFit, safe_predict

    model, ref = _pair("functional")
    place(model, cpu_layers=["emb"], accelerator=ACC)
    x, y = _data(n=32)
    ref_history = ref.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    inject_oom(8, phases=("train",))  # every 16-row step fails: MemFit splits it
    history = model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0,
                        callbacks=[MemFit()])
    inject_oom(None)
    assert inject_oom.ooms(), "no OOM was injected"
    np.testing.assert_allclose(history.history["loss"], ref_history.history["loss"], rtol=1e-5)
    for got, want in zip(model.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    assert _device(model.get_layer("emb").embeddings) == HOST
    np.testing.assert_allclose(safe_predict(model, x, batch_size=32),
                               ref.predict(x, verbose=0), rtol=1e-5, atol=1e-6)


def test_memfit_place_option_places_once_and_trains_like_place_then_fit(inject_oom, monkeypatch):
    from keras_memfit import MemFit

    model, ref = _pair("functional")
    x, y = _data(n=32)
    ref_plan = place(ref, budget=10_000_000, accelerator=ACC)
    ref_history = ref.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)

    calls = []
    real_place = placement.place
    monkeypatch.setattr(placement, "place", lambda *a, **k: calls.append(k) or real_place(*a, **k))
    memfit = MemFit(place={"budget": 10_000_000, "accelerator": ACC})
    inject_oom(8, phases=("train",))  # every 16-row step fails: MemFit splits it
    history = model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0,
                        callbacks=[memfit])
    history2 = model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0,
                         callbacks=[memfit])  # placed already: not placed again
    inject_oom(None)
    assert inject_oom.ooms(), "no OOM was injected"
    assert calls == [{"budget": 10_000_000, "accelerator": ACC}]
    assert memfit.plan.cpu_layers == ref_plan.cpu_layers == ["emb"]
    assert _device(model.get_layer("emb").embeddings) == HOST
    assert _device(model.get_layer("conv").kernel) == ACC
    assert all(_device(v) == HOST for v in model.optimizer.variables
               if v.shape == model.get_layer("emb").embeddings.shape)
    np.testing.assert_allclose(history.history["loss"] + history2.history["loss"],
                               ref_history.history["loss"], rtol=1e-5)
    for got, want in zip(model.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


# --------------------------------------------------------------- XLA, saving
def test_pinning_turns_xla_off_also_after_a_later_compile(caplog):
    model = _sequential()
    model.compile(optimizer="adam", loss="mse", jit_compile=True)
    with caplog.at_level(logging.INFO, logger="keras_memfit"):
        place(model, cpu_layers=["emb"], accelerator=ACC)
    assert model.jit_compile is False
    assert any("jit_compile" in r.getMessage() for r in caplog.records)
    model.compile(optimizer="adam", loss="mse", jit_compile=True)
    assert model.jit_compile is False


def test_save_and_load_keep_weights_and_outputs(tmp_path):
    model, ref = _pair("functional")
    place(model, cpu_layers=["emb"], accelerator=ACC)
    x, y = _data()
    model.train_on_batch(x, y)
    ref.train_on_batch(x, y)
    path = str(tmp_path / "placed.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    for got, want in zip(loaded.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for got, want in zip(loaded.optimizer.variables, ref.optimizer.variables):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), ref.predict(x, verbose=0),
                               rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------- dict/list inputs
USERS, ITEMS, UDIM, IDIM, ITEM_LEN = 1000, 50, 8, 4, 3
# Pinning user_emb: its output, 1 x UDIM floats per sample, crosses; pinning
# both tables: also the item table's ITEM_LEN x IDIM floats.
USER_CUT, ITEM_CUT = 1 * UDIM * 4, ITEM_LEN * IDIM * 4


def _two_inputs(structure):
    user = keras.Input((1,), dtype="int32", name="user")
    item = keras.Input((ITEM_LEN,), dtype="int32", name="item")
    u = keras.layers.Embedding(USERS, UDIM, name="user_emb")(user)
    i = keras.layers.Embedding(ITEMS, IDIM, name="item_emb")(item)
    u, i = keras.layers.Flatten(name="u_flat")(u), keras.layers.Flatten(name="i_flat")(i)
    h = keras.layers.Concatenate(name="cat")([u, i])
    out = keras.layers.Dense(1, name="head")(keras.layers.Dense(8, name="mlp")(h))
    inputs = {"user": user, "item": item} if structure == "dict" else structure((user, item))
    return keras.Model(inputs, out)


class TwoInputs(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.user_emb = keras.layers.Embedding(USERS, UDIM, name="user_emb")
        self.item_emb = keras.layers.Embedding(ITEMS, IDIM, name="item_emb")
        self.head = keras.layers.Dense(1, name="head")

    def call(self, x):
        u = keras.ops.reshape(self.user_emb(x["user"]), (-1, UDIM))
        i = keras.ops.reshape(self.item_emb(x["item"]), (-1, ITEM_LEN * IDIM))
        return self.head(keras.ops.concatenate([u, i], axis=-1))


def _two_input_data(n=16):
    rng = np.random.default_rng(3)
    return {"user": rng.integers(0, USERS, (n, 1)).astype("int32"),
            "item": rng.integers(0, ITEMS, (n, ITEM_LEN)).astype("int32")}


@pytest.mark.parametrize("kind", ["functional-dict", "functional-list", "functional-tuple",
                                  "subclassed-dict"])
def test_crossing_of_models_with_dict_and_list_inputs(kind):
    def build():
        if kind == "subclassed-dict":
            model = TwoInputs()
            model(_two_input_data(2))
            return model
        return _two_inputs({"functional-dict": "dict", "functional-list": list,
                            "functional-tuple": tuple}[kind])

    keras.utils.set_random_seed(2)
    model, ref = build(), build()
    ref.set_weights(model.get_weights())
    plan = place(model, cpu_layers=["user_emb"], accelerator=ACC)
    assert plan.crossing_bytes_per_sample == USER_CUT
    plan = place(model, cpu_layers=["user_emb", "item_emb"], accelerator=ACC)
    assert plan.crossing_bytes_per_sample == USER_CUT + ITEM_CUT
    data = _two_input_data()
    x = data if kind.endswith("dict") else [data["user"], data["item"]]
    np.testing.assert_allclose(model.predict(x, verbose=0), ref.predict(x, verbose=0),
                               rtol=1e-6, atol=1e-6)
    assert _device(model.get_layer("user_emb").embeddings) == HOST
    assert _device(model.get_layer("head").kernel) == ACC


def test_a_pinned_layer_that_returns_its_input_sends_it_back_across():
    x = keras.Input((16,))
    h = keras.layers.Dense(32, name="a")(x)
    h = keras.layers.Dropout(0.5, name="drop")(h)  # at inference: its input, unchanged
    model = keras.Model(x, keras.layers.Dense(2, name="b")(h))
    plan = place(model, cpu_layers=["drop"], accelerator=ACC)
    assert plan.crossing_bytes_per_sample == 2 * 32 * 4  # to the host and back
    plan = place(model, cpu_layers=["a", "drop"], accelerator=ACC)
    assert plan.crossing_bytes_per_sample == 32 * 4  # only drop's output returns


def test_place_analyses_the_model_once_without_running_it(monkeypatch):
    import tensorflow as tf

    from keras_memfit.backend import tensorflow as tf_backend

    eager_calls, traces = [], []

    class Watched(keras.layers.Layer):
        def call(self, x):
            eager_calls.append(tf.executing_eagerly())
            return x * 2.0

    real_trace = tf_backend.trace_layer_calls
    monkeypatch.setattr(tf_backend, "trace_layer_calls",
                        lambda model: traces.append(model) or real_trace(model))
    ids = keras.Input((SEQ,), dtype="int32")
    h = keras.layers.Embedding(ROWS, DIM, name="emb")(ids)
    h = keras.layers.Flatten()(Watched(name="watched")(h))
    model = _compile(keras.Model(ids, keras.layers.Dense(CLASSES, name="head")(h)))
    for kwargs in ({"budget": 10_000_000}, {"cpu_layers": ["emb"]}):
        eager_calls.clear(), traces.clear()
        plan = place(model, accelerator=ACC, **kwargs)
        assert plan.cpu_layers == ["emb"] and plan.crossing_bytes_per_sample == CUT_BYTES
        assert traces == [model] and True not in eager_calls, kwargs


# ------------------------------------------------------- memory report after place
def test_memory_report_after_place_estimates_each_device_and_fits_the_accelerator():
    from keras_memfit import memory_report

    model = _compile(_sequential())
    batch, budget = 64, 10_000_000
    before = memory_report(model, batch, budget=budget)
    assert before.max_batch_size() == 0  # the table and its slots alone exceed the budget
    place(model, budget=budget, accelerator=ACC)
    report = memory_report(model, batch, budget=budget)
    # Hand-computed, training with Adam: weights + 2 slots + gradient + 2 update
    # temporaries of the largest trainable weight, per device.
    conv_kernel = 3 * DIM * FILTERS * 4
    host_fixed = TABLE_BYTES * (1 + 2 + 1 + 2)
    acc_fixed = 4 * REST_PARAMS * (1 + 2 + 1) + 2 * conv_kernel
    # Per sample: the host holds the ids and the embedding's output (+2 copies
    # of its largest activation); the accelerator gets the crossing embedding
    # output plus conv/pool/head outputs (+2 copies of the conv output).
    ids, emb_out, conv_out, pool_out, head_out = SEQ * 4, CUT_BYTES, 6 * FILTERS * 4, \
        FILTERS * 4, CLASSES * 4
    host_per_sample = ids + emb_out + 2 * emb_out
    acc_per_sample = emb_out + conv_out + pool_out + head_out + 2 * conv_out
    assert report.device == "CPU:1"
    assert set(report.per_device) == {"CPU:0", "CPU:1"}
    host, acc = report.per_device["CPU:0"], report.per_device["CPU:1"]
    assert (host.fixed_bytes, host.bytes_per_sample) == (host_fixed, host_per_sample)
    assert (acc.fixed_bytes, acc.bytes_per_sample) == (acc_fixed, acc_per_sample)
    assert (host.param_bytes, acc.param_bytes) == (TABLE_BYTES, 4 * REST_PARAMS)
    assert (report.fixed_bytes, report.bytes_per_sample) == (acc_fixed, acc_per_sample)
    assert report.peak_bytes == acc_fixed + batch * acc_per_sample
    assert report.max_batch_size() == (budget - acc_fixed) // acc_per_sample > 0
    assert report.max_batch_size(device="/CPU:0") == 0
    assert report.peak_bytes_on("CPU:0") == host_fixed + batch * host_per_sample
    on_host = memory_report(model, batch, device="/CPU:0")
    assert (on_host.device, on_host.fixed_bytes) == ("CPU:0", host_fixed)
    # The totals are still the whole model's.
    assert (report.param_bytes, report.slot_bytes) == (before.param_bytes, before.slot_bytes)
    text = str(report)
    assert "Estimated peak on CPU:1 at batch_size=64" in text
    assert "CPU:0: 36.6 MiB weights + slots" in text
    # Inference: the accelerator's live set peaks at the conv (its input, the
    # crossing embedding output, plus its output); slots not built: not resident.
    inference = memory_report(model, batch, training=False)
    assert inference.fixed_bytes == 4 * REST_PARAMS
    assert inference.bytes_per_sample == emb_out + conv_out
    with pytest.raises(ValueError, match=r"CPU:0, CPU:1.*'/GPU:3'"):
        memory_report(model, batch, device="/GPU:3")


# ------------------------------------------------------ no accelerator, errors
def test_without_accelerator_nothing_changes_and_place_says_so_once(monkeypatch, caplog):
    from keras_memfit.backend import tensorflow as tf_backend

    monkeypatch.setattr(tf_backend, "list_accelerators", list)
    monkeypatch.setattr(placement, "_said_no_accelerator", False)
    model = _sequential()
    before = {v.path: _device(v) for v in model.weights}
    with caplog.at_level(logging.INFO, logger="keras_memfit"):
        first = place(model, budget=1000)
        second = place(model, cpu_layers=["emb"])
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "no GPU" in warnings[0].getMessage()
    assert not first.applied and not second.applied
    assert first.cpu_layers == [] and first.accelerator is None
    assert {v.path: _device(v) for v in model.weights} == before
    assert "call" not in model.get_layer("emb").__dict__


@pytest.mark.parametrize(
    "kwargs, received",
    [
        ({"cpu_layers": ["nope"]}, "'nope'"),
        ({"cpu_layers": 3}, "cpu_layers=3"),
        ({"budget": 0}, "budget=0"),
        ({"budget": -5}, "budget=-5"),
        ({"accelerator": "/GPU:7"}, "'/GPU:7'"),
        ({"accelerator": "banana"}, "'banana'"),
        ({"accelerator": "/CPU:0"}, "'/CPU:0'"),
    ],
)
def test_bad_arguments_raise_value_error_naming_what_was_received(kwargs, received):
    kwargs.setdefault("accelerator", ACC)
    with pytest.raises(ValueError, match=received.replace("/", ".").replace(":", ".")):
        place(_sequential(), **kwargs)


def test_automatic_choice_on_an_unbuilt_model_asks_for_build_or_cpu_layers():
    with pytest.raises(ValueError, match="cpu_layers"):
        place(_subclassed(built=False), budget=1000, accelerator=ACC)


def test_summary_and_to_dict_describe_the_plan():
    model = _compile(_sequential())
    plan = place(model, cpu_layers=[model.get_layer("emb")], accelerator=ACC)
    lines = []
    plan.summary(print_fn=lines.append)
    emb_line = next(line for line in lines if line.strip().startswith("emb"))
    assert HOST in emb_line
    assert ACC in next(line for line in lines if line.strip().startswith("conv"))
    as_dict = plan.to_dict()
    assert as_dict["cpu_layers"] == ["emb"]
    assert as_dict["crossing_bytes_per_sample"] == CUT_BYTES
    assert as_dict["device_bytes"][HOST] == 3 * TABLE_BYTES
