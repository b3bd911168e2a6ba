"""`memory_report` with Keras on JAX: the same report as on TensorFlow, no TensorFlow needed.

Each report is made in a child process with `KERAS_BACKEND=jax`
(`tests/jax_support.py`) and checked against two independent references:
arithmetic from the layers' shapes (weights, Adam's two slots per trainable
weight, activations of `batch_size` rows of float32), and, where this test
process runs Keras on TensorFlow, the TensorFlow backend's report of the
same model (every number but the device's spelling).
"""

from __future__ import annotations

import json
import math

import pytest

from tests.jax_support import requires_jax, run_in_jax

pytestmark = requires_jax

BATCH = 128


def _models():
    """(name, model) pairs: the demo's CNN, a two-input functional model with BatchNorm, EfficientNetB0."""
    import keras

    from keras_memfit.app.demo import build_cnn

    keras.utils.set_random_seed(0)
    a, b = keras.Input((784,), name="a"), keras.Input((16,), name="b")
    h = keras.layers.Dense(256, activation="relu", name="hidden")(a)
    h = keras.layers.BatchNormalization(name="norm")(h)
    h = keras.layers.Concatenate(name="join")([h, b])
    out = keras.layers.Dense(10, activation="softmax", name="out")(h)
    functional = keras.Model([a, b], out, name="two_inputs")
    functional.compile("adam", "sparse_categorical_crossentropy")
    # keras.applications: its layers call functional ops (a new Operation per call)
    efficientnet = keras.applications.EfficientNetB0(
        weights=None, input_shape=(32, 32, 3), classes=10)
    efficientnet.compile("adam", "sparse_categorical_crossentropy")
    return [("cnn", build_cnn()), ("two_inputs", functional), ("efficientnet", efficientnet)]


def _reports():
    """Each model's `memory_report(model, BATCH).to_dict()`, by name.

    Keras's name counters start afresh first, so the layers are named as in
    a fresh process whatever ran before (the JAX side runs in a child).
    """
    import keras

    from keras_memfit import memory_report

    keras.utils.clear_session()
    return {name: memory_report(model, BATCH).to_dict() for name, model in _models()}


def child_reports():
    import keras

    assert keras.backend.backend() == "jax"
    print("REPORTS " + json.dumps(_reports()))


@pytest.fixture(scope="module")
def jax_reports():
    """The reports made on JAX (one child process for the module)."""
    out = run_in_jax(__file__, "child_reports")
    line = next(line for line in out.splitlines() if line.startswith("REPORTS "))
    return json.loads(line[len("REPORTS "):])


def test_memory_report_on_jax_matches_the_arithmetic_of_the_layers(jax_reports):
    reports = jax_reports
    expected = {  # name: (output shape per sample, params, trainable params)
        "cnn": {
            "conv2d": ((26, 26, 32), 3 * 3 * 1 * 32 + 32, 320),
            "conv2d_1": ((24, 24, 64), 3 * 3 * 32 * 64 + 64, 18496),
            "max_pooling2d": ((12, 12, 64), 0, 0),
            "flatten": ((9216,), 0, 0),
            "dense": ((10,), 9216 * 10 + 10, 92170),
        },
        "two_inputs": {
            "hidden": ((256,), 784 * 256 + 256, 200960),
            "norm": ((256,), 4 * 256, 2 * 256),  # gamma, beta trainable; moving stats not
            "join": ((272,), 0, 0),
            "out": ((10,), 272 * 10 + 10, 2730),
        },
    }
    for model, layers in expected.items():
        rows = {row["name"]: row for row in reports[model]["rows"]}
        assert set(rows) == set(layers), (model, sorted(rows))
        for name, (shape, params, trainable) in layers.items():
            row = rows[name]
            assert tuple(row["output_shape"]) == shape, (model, name, row)
            assert row["params"] == params, (model, name, row)
            assert row["param_bytes"] == 4 * params, (model, name, row)
            assert row["slot_bytes"] == 2 * 4 * trainable, (model, name, row)  # Adam: m and v
            assert row["activation_bytes"] == 4 * BATCH * math.prod(shape), (model, name, row)
        assert reports[model]["batch_size"] == BATCH
        assert reports[model]["peak_bytes"] > sum(r["param_bytes"] for r in rows.values())


def test_memory_report_on_jax_equals_the_tensorflow_report(jax_reports):
    pytest.importorskip("tensorflow", reason="the TensorFlow report is the reference")
    import keras

    if keras.backend.backend() != "tensorflow":
        pytest.skip(
            f"this test process runs Keras on {keras.backend.backend()!r}; the reference "
            "is the TensorFlow backend's report, made in the test process"
        )
    reference = _reports()
    got = json.loads(json.dumps(jax_reports))  # a copy: the rows are edited below
    for model, report in reference.items():
        mine = got[model]
        for row in report["rows"] + mine["rows"]:
            row.pop("device")  # "CPU:0" on TensorFlow, "cpu:0" on JAX
        for entry in report.get("devices") or []:
            entry.pop("device", None)
        for entry in mine.get("devices") or []:
            entry.pop("device", None)
        # Normalization's `count` is int64 on TensorFlow, int32 on JAX (no x64): 4 bytes.
        slack = 0
        for row in report["rows"] + mine["rows"]:
            if row["class_name"] == "Normalization":
                row.pop("param_bytes")
                slack += 2
        assert mine["rows"] == report["rows"], model
        for key in ("params", "param_bytes", "slot_bytes", "activation_bytes", "flops",
                    "fixed_bytes", "bytes_per_sample", "peak_bytes"):
            if key in ("param_bytes", "fixed_bytes", "peak_bytes") and slack:
                assert abs(mine.get(key) - report.get(key)) <= slack, (model, key)
                continue
            assert mine.get(key) == report.get(key), (model, key)
