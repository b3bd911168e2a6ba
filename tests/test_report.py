"""Tests for `keras_memfit.memory_report`.

Expected numbers are computed by hand from the layers' definitions (shapes x
4 bytes for float32), from Keras's own counts (`count_params`, the built
optimizer's variables) or, for the peak estimate, from TensorFlow's allocator
(`get_memory_info` under the capped BFC allocator).
"""

from __future__ import annotations

import functools
import gc
import json

import keras
import numpy as np
import pytest

from keras_memfit import memory_report
from keras_memfit.report import LayerMemory, MemoryReport
from support import requires_memory_report

# memory_report names devices in short form on every backend (JAX's "cpu:0" too).
HOST_DEVICE = "CPU:0"

pytestmark = requires_memory_report()

F32 = 4


def embedding_model(optimizer="adam"):
    model = keras.Sequential(
        [
            keras.Input((4,), dtype="int32"),
            keras.layers.Embedding(100, 8, name="emb"),
            keras.layers.Flatten(name="flat"),
            keras.layers.Dense(3, name="head"),
        ]
    )
    if optimizer is not None:
        model.compile(optimizer=optimizer, loss="mse")
    return model


def conv_model():
    return keras.Sequential(
        [
            keras.Input((10, 10, 4)),
            keras.layers.Conv2D(6, 3, name="conv"),  # -> (8, 8, 6)
            keras.layers.Conv2D(4, 3, groups=2, name="grouped"),  # -> (6, 6, 4)
            keras.layers.DepthwiseConv2D(3, name="depthwise"),  # -> (4, 4, 4)
            keras.layers.MaxPooling2D(2, name="pool"),  # -> (2, 2, 4)
            keras.layers.Flatten(name="flat"),  # -> (16,)
            keras.layers.Dense(5, name="head"),
        ]
    )


def by_name(report):
    return {row.name: row for row in report.rows}


# --------------------------------------------------------------------------
# Hand-computed values
# --------------------------------------------------------------------------
def test_sequential_embedding_model_matches_hand_computed_values():
    model = embedding_model(optimizer=None)
    report = memory_report(model, batch_size=10)
    assert [r.name for r in report.rows] == ["emb", "flat", "head"]
    emb, flat, head = report.rows
    assert (emb.class_name, flat.class_name, head.class_name) == ("Embedding", "Flatten", "Dense")
    assert emb.output_shape == (4, 8) and flat.output_shape == (32,) and head.output_shape == (3,)
    assert (emb.params, flat.params, head.params) == (800, 0, 32 * 3 + 3)
    assert report.params == model.count_params()
    assert (emb.param_bytes, flat.param_bytes, head.param_bytes) == (3200, 0, 99 * F32)
    # Activations at batch 10: (4 x 8), (32,), (3,) floats per sample.
    assert (emb.activation_bytes, flat.activation_bytes, head.activation_bytes) == (
        10 * 32 * F32, 10 * 32 * F32, 10 * 3 * F32)
    # A gather has no multiply-adds; Dense: 2 x 32 x 3 per sample.
    assert (emb.flops, flat.flops, head.flops) == (0, 0, 10 * 2 * 32 * 3)
    # Cutting after a layer sends its output across; after the last, nothing.
    assert [r.cut_bytes_per_sample for r in report.rows] == [32 * F32, 32 * F32, 0]
    assert emb.device.endswith(HOST_DEVICE) and flat.device == "-"
    assert report.slot_bytes == 0  # not compiled: no optimizer
    assert report.input_bytes_per_sample == 4 * 4  # four int32 ids


def test_conv_model_flops_params_and_activations_by_hand():
    model = conv_model()
    report = memory_report(model, batch_size=3, training=False)
    rows = by_name(report)
    # Conv2D 3x3, 4 -> 6 channels, output 8x8.
    assert rows["conv"].params == 3 * 3 * 4 * 6 + 6
    assert rows["conv"].flops == 3 * (2 * 9 * 4 * 6 * 8 * 8)
    assert rows["conv"].output_shape == (8, 8, 6)
    # Grouped: each of the 4 filters sees 6 / 2 = 3 channels; output 6x6.
    assert rows["grouped"].params == 3 * 3 * 3 * 4 + 4
    assert rows["grouped"].flops == 3 * (2 * 9 * 3 * 4 * 6 * 6)
    # Depthwise 3x3 on 4 channels; output 4x4x4.
    assert rows["depthwise"].params == 3 * 3 * 4 + 4
    assert rows["depthwise"].flops == 3 * (2 * 9 * 4 * 4 * 4)
    # Max pooling 2x2: 4 comparisons per output of 2x2x4.
    assert rows["pool"].flops == 3 * (4 * 2 * 2 * 4)
    assert rows["head"].flops == 3 * (2 * 16 * 5)
    assert report.flops == sum(r.flops for r in report.rows)
    assert rows["grouped"].activation_bytes == 3 * 6 * 6 * 4 * F32
    assert report.params == model.count_params()
    assert report.param_bytes == sum(int(np.prod(w.shape)) * F32 for w in model.weights)


def test_functional_branch_cut_counts_every_tensor_crossing():
    inputs = keras.Input((8,), name="x")
    a = keras.layers.Dense(5, name="a")(inputs)
    c = keras.layers.Dense(6, name="c")(a)
    merged = keras.layers.Concatenate(name="merge")([inputs, c])  # skip from the input
    outputs = keras.layers.Dense(2, name="out")(merged)
    model = keras.Model(inputs, outputs)
    report = memory_report(model, batch_size=1)
    assert [r.name for r in report.rows] == ["a", "c", "merge", "out"]
    cuts = {r.name: r.cut_bytes_per_sample for r in report.rows}
    # After "a": the input (still needed by merge) and a (needed by c).
    assert cuts["a"] == (8 + 5) * F32
    # After "c": the input and c, both needed by merge; a is done.
    assert cuts["c"] == (8 + 6) * F32
    assert cuts["merge"] == 14 * F32
    assert cuts["out"] == 0
    assert by_name(report)["merge"].flops == 0


def test_subclassed_model_rows_and_model_left_untouched():
    class TwoDense(keras.Model):
        def __init__(self):
            super().__init__()
            self.hidden = keras.layers.Dense(7, activation="relu", name="hidden")
            self.top = keras.layers.Dense(3, name="top")

        def call(self, x):
            return self.top(self.hidden(x))

    model = TwoDense()
    with pytest.raises(ValueError, match="has not been built"):
        memory_report(model)
    x = np.random.default_rng(0).normal(size=(4, 5)).astype("float32")
    before = model.predict_on_batch(x)
    call_before = keras.layers.Layer.__call__
    report = memory_report(model, batch_size=4)
    assert keras.layers.Layer.__call__ is call_before
    assert [r.name for r in report.rows] == ["hidden", "top"]
    hidden, top = report.rows
    assert hidden.output_shape == (7,) and top.output_shape == (3,)
    assert (hidden.params, top.params) == (5 * 7 + 7, 7 * 3 + 3)
    assert (hidden.flops, top.flops) == (4 * 2 * 5 * 7, 4 * 2 * 7 * 3)
    assert hidden.cut_bytes_per_sample == 7 * F32
    np.testing.assert_array_equal(model.predict_on_batch(x), before)
    assert model.losses == []


def test_model_built_without_its_layers_is_refused_untouched():
    class NoBuild(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(3, name="dense")

        def call(self, x):
            return self.dense(x)

    model = NoBuild()
    with pytest.warns(UserWarning):
        model.build((None, 7))  # Keras marks it built; its Dense is not
    with pytest.raises(ValueError, match=r"unbuilt layers \['dense'\]"):
        memory_report(model)
    assert not model.dense.built and model.variables == []


def test_nested_model_is_one_row_with_its_sublayers_counted():
    inner = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4), keras.layers.Dense(2)],
                             name="inner")
    outer = keras.Sequential([keras.Input((3,)), keras.layers.Dense(6, name="first"), inner])
    report = memory_report(outer, batch_size=2)
    assert [r.name for r in report.rows] == ["first", "inner"]
    row = by_name(report)["inner"]
    assert row.params == 6 * 4 + 4 + 4 * 2 + 2
    assert row.flops == 2 * (2 * 6 * 4 + 2 * 4 * 2)
    assert row.activation_bytes == 2 * (4 + 2) * F32  # both inner outputs kept
    assert row.output_shape == (2,)


def test_shared_layer_and_non_layer_ops_in_a_subclassed_call():
    class Doubled(keras.Model):
        def __init__(self):
            super().__init__()
            self.a = keras.layers.Dense(6, name="a")
            self.b = keras.layers.Dense(2, name="b")
            self.unused = keras.layers.Dense(5, name="unused")  # its call skips it
            self.unused.build((None, 2))

        def call(self, x):
            return self.b(self.a(x) * 2.0)  # `* 2.0` is no layer: it gets no row

    model = Doubled()
    model(np.zeros((1, 3), "float32"))
    report = memory_report(model, batch_size=1)
    assert [r.name for r in report.rows] == ["a", "b", "(other weights)"]
    assert report.rows[2].params == 2 * 5 + 5 and report.params == model.count_params()
    # The product is counted as produced by the row before its consumer.
    assert report.rows[0].cut_bytes_per_sample == 6 * F32

    shared = keras.layers.Dense(3, name="shared")
    x = keras.Input((3,))
    twice = keras.Model(x, shared(shared(x)))
    rows = memory_report(twice, batch_size=1).rows
    assert [r.name for r in rows] == ["shared", "shared (call 2)"]
    assert (rows[0].params, rows[1].params) == (12, 0)  # weights counted once
    assert rows[0].flops == rows[1].flops == 2 * 3 * 3


# --------------------------------------------------------------------------
# Optimizer slots
# --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "optimizer, per_weight",
    [
        (lambda: keras.optimizers.Adam(), 2),
        (lambda: keras.optimizers.SGD(), 0),
        (lambda: keras.optimizers.SGD(momentum=0.9), 1),
    ],
    ids=["adam", "sgd", "sgd-momentum"],
)
def test_slot_bytes_per_optimizer_before_and_after_it_is_built(optimizer, per_weight):
    model = embedding_model(optimizer())
    report = memory_report(model, batch_size=2)
    for row in report.rows:
        assert row.slot_bytes == per_weight * row.param_bytes
    assert not model.optimizer.built  # the report did not build it
    x = np.random.default_rng(0).integers(0, 100, size=(2, 4)).astype("int32")
    model.train_on_batch(x, np.zeros((2, 3), "float32"))
    built = sum(
        int(np.prod(v.shape)) * F32 for v in model.optimizer.variables if np.prod(v.shape) > 1
    )
    assert memory_report(model, batch_size=2).slot_bytes == built


def test_loss_scale_optimizer_is_looked_through():
    model = embedding_model(keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam()))
    report = memory_report(model, batch_size=2)
    assert report.slot_bytes == 2 * report.param_bytes == 2 * (800 + 99) * F32


def test_dtype_policy_halves_activations_not_weights_or_slots():
    model = conv_model()
    model.compile(optimizer="adam", loss="mse")
    plain = memory_report(model, batch_size=4)
    mixed = memory_report(model, batch_size=4, dtype_policy="mixed_float16")
    assert mixed.param_bytes == plain.param_bytes and mixed.slot_bytes == plain.slot_bytes
    assert mixed.activation_bytes * 2 == plain.activation_bytes
    assert mixed.dtype_policy == "mixed_float16"
    half = memory_report(model, batch_size=4, dtype_policy="float16")
    assert half.param_bytes * 2 == plain.param_bytes


# --------------------------------------------------------------------------
# Estimate, budget, output
# --------------------------------------------------------------------------
def test_max_batch_size_is_consistent_with_the_peak_estimate():
    report = memory_report(conv_model(), batch_size=8)
    assert report.peak_bytes == report.peak_bytes_at(8)
    assert report.peak_bytes_at(9) - report.peak_bytes_at(8) == report.bytes_per_sample > 0
    budgets = [report.fixed_bytes + k * 997 for k in (1, 50, 500, 5000)]
    fits = [report.max_batch_size(b) for b in budgets]
    assert fits == sorted(fits) and fits[-1] > fits[0]
    for budget, n in zip(budgets, fits):
        if n:
            assert report.peak_bytes_at(n) <= budget
        assert report.peak_bytes_at(n + 1) > budget
    assert report.max_batch_size(max(1, report.fixed_bytes - 1)) == 0  # weights alone
    with_budget = memory_report(conv_model(), batch_size=8, budget=budgets[2])
    assert with_budget.max_batch_size() == fits[2]
    assert with_budget.to_dict()["max_batch_size"] == fits[2]


def test_training_estimate_exceeds_inference_estimate():
    model = embedding_model("adam")
    train = memory_report(model, batch_size=64, training=True)
    infer = memory_report(model, batch_size=64, training=False)
    # Training keeps slots, gradients and every activation.
    assert train.peak_bytes > infer.peak_bytes + train.slot_bytes
    assert not infer.training and train.training


def test_to_dict_is_json_and_mirrors_rows():
    report = memory_report(embedding_model(), batch_size=5, budget=1 << 20)
    data = json.loads(json.dumps(report.to_dict()))
    assert [r["name"] for r in data["rows"]] == ["emb", "flat", "head"]
    assert data["rows"][0]["output_shape"] == [4, 8]
    assert data["rows"][2]["flops"] == 5 * 2 * 32 * 3
    assert data["peak_bytes"] == report.peak_bytes and data["budget"] == 1 << 20
    assert data["param_bytes"] == (800 + 99) * F32
    assert isinstance(report.rows[0], LayerMemory) and isinstance(report, MemoryReport)


def test_summary_goes_through_print_fn_like_model_summary():
    report = memory_report(embedding_model(), batch_size=10, budget=1 << 20)
    lines = []
    report.summary(print_fn=lines.append)
    assert len(lines) == 1
    text = lines[0]
    assert text == str(report)
    for expected in ("emb (Embedding)", "head (Dense)", "(4, 8)", "Total", "Slots",
                     "Estimated peak at batch_size=10", "Largest batch predicted to fit 1.0 MiB"):
        assert expected in text
    narrow = []
    report.summary(print_fn=narrow.append, line_length=60)
    assert max(len(line) for line in narrow[0].splitlines()) < max(
        len(line) for line in text.splitlines())


# --------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------
def test_one_device_model_reports_that_device_and_refuses_others():
    # Multi-device models: tests/test_placement.py (two logical devices).
    model = embedding_model()
    report = memory_report(model, batch_size=10, budget=1 << 20)
    assert report.device == HOST_DEVICE and list(report.per_device) == [HOST_DEVICE]
    only = report.per_device[HOST_DEVICE]
    params = 100 * 8 + 32 * 3 + 3
    assert (only.param_bytes, only.slot_bytes) == (params * F32, 2 * params * F32)
    assert (only.fixed_bytes, only.bytes_per_sample) == (
        report.fixed_bytes, report.bytes_per_sample)
    same = memory_report(model, batch_size=10, budget=1 << 20, device="/device:CPU:0")
    assert (same.fixed_bytes, same.bytes_per_sample) == (
        report.fixed_bytes, report.bytes_per_sample)
    assert report.max_batch_size(device="cpu:0") == report.max_batch_size()
    assert report.peak_bytes_on(HOST_DEVICE) == report.peak_bytes
    assert "Estimated peak at batch_size=10" in str(report)
    assert "Per device" not in str(report)
    assert report.to_dict()["per_device"][HOST_DEVICE]["fixed_bytes"] == report.fixed_bytes
    with pytest.raises(ValueError, match=rf"\({HOST_DEVICE}\); received device='/GPU:3'"):
        memory_report(model, device="/GPU:3")
    with pytest.raises(ValueError, match="received device=5"):
        memory_report(model, device=5)
    with pytest.raises(ValueError, match="received device='GPU:1'"):
        report.max_batch_size(1 << 20, device="GPU:1")


@pytest.mark.parametrize("batch_size", [0, -3, "a", None, 2.5, True])
def test_bad_batch_size_names_the_value(batch_size):
    with pytest.raises(ValueError, match=f"received batch_size={batch_size!r}"):
        memory_report(embedding_model(None), batch_size=batch_size)


@pytest.mark.parametrize("budget", [0, -1, "1GB"])
def test_bad_budget_names_the_value(budget):
    with pytest.raises(ValueError, match=f"received budget={budget!r}"):
        memory_report(embedding_model(None), budget=budget)


def test_other_bad_arguments():
    model = embedding_model(None)
    with pytest.raises(ValueError, match="received training='yes'"):
        memory_report(model, training="yes")
    with pytest.raises(ValueError, match="received dtype_policy='float99'"):
        memory_report(model, dtype_policy="float99")
    with pytest.raises(TypeError, match="received str"):
        memory_report("model.keras")
    report = memory_report(model)
    with pytest.raises(ValueError, match="received budget=None"):
        report.max_batch_size()
    with pytest.raises(ValueError, match="received budget=-5"):
        report.max_batch_size(-5)


# --------------------------------------------------------------------------
# Against TensorFlow's allocator
# --------------------------------------------------------------------------
# Observed est/measured ratios (TF 2.21, Keras 3.15, 2 CPU cores, BFC allocator):
# 0.56 to 1.20 over an MLP, the digits CNN and an Embedding+Conv1D model at batch
# sizes 64 to 1024, predict and train. The bound leaves room for allocator
# rounding, which differs between machines.
LOW, HIGH = 0.45, 2.0


@pytest.mark.memory_cap(3000)
def test_peak_estimate_against_measured_peak():
    import tensorflow as tf

    from keras_memfit.app.demo import build_cnn

    def mlp():
        model = keras.Sequential([
            keras.Input((784,)),
            keras.layers.Dense(1024, activation="relu"),
            keras.layers.Dense(1024, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ])
        model.compile(keras.optimizers.Adam(), "sparse_categorical_crossentropy")
        return model

    def measured(fn, base):
        fn()  # trace and build first
        gc.collect()
        tf.config.experimental.reset_memory_stats("CPU:0")
        fn()
        return tf.config.experimental.get_memory_info("CPU:0")["peak"] - base

    def embedding_conv():
        model = keras.Sequential([
            keras.Input((50,), dtype="int32"),
            keras.layers.Embedding(20000, 64),
            keras.layers.Conv1D(64, 5, activation="relu"),
            keras.layers.GlobalMaxPooling1D(),
            keras.layers.Dense(10, activation="softmax"),
        ])
        model.compile(keras.optimizers.SGD(momentum=0.9), "sparse_categorical_crossentropy")
        return model

    rng = np.random.default_rng(0)
    ratios = {}
    cases = [
        ("mlp", mlp, (784,), "float32", 512),
        ("cnn", build_cnn, (28, 28, 1), "float32", 512),
        ("embedding", embedding_conv, (50,), "int32", 512),
    ]
    for name, build, shape, dtype, batch in cases:
        keras.backend.clear_session()
        gc.collect()
        base = tf.config.experimental.get_memory_info("CPU:0")["current"]
        model = build()
        x = (rng.random((batch, *shape)) * 100).astype(dtype)
        y = rng.integers(0, 10, batch)
        predict = measured(functools.partial(model.predict_on_batch, x), base)
        ratios[name, "predict"] = memory_report(model, batch, training=False).peak_bytes / predict
        train = measured(functools.partial(model.train_on_batch, x, y), base)
        ratios[name, "train"] = memory_report(model, batch, training=True).peak_bytes / train
    print("estimate / measured:", {k: round(v, 2) for k, v in ratios.items()})
    for key, ratio in ratios.items():
        assert LOW <= ratio <= HIGH, (key, ratio)


@pytest.mark.memory_cap(1000)
def test_a_two_million_row_table_costs_the_report_no_memory():
    import tensorflow as tf

    model = keras.Sequential([
        keras.Input((5,), dtype="int32"),
        keras.layers.Embedding(2_000_000, 16, name="table"),
        keras.layers.Flatten(),
        keras.layers.Dense(8),
    ])
    model.compile(optimizer="adam", loss="mse")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    tf.config.experimental.reset_memory_stats("CPU:0")
    report = memory_report(model, batch_size=1)
    grew = tf.config.experimental.get_memory_info("CPU:0")["peak"] - before
    table = 2_000_000 * 16 * F32
    assert report.rows[0].param_bytes == table
    assert report.rows[0].slot_bytes == 2 * table  # Adam's two moments, not allocated
    assert grew < (1 << 20), grew
    assert not model.optimizer.built
