"""`place` on keras-rs's own embedding layers, at the size issue 21 reports.

keras-rs's `EmbedReduce` (a `keras.layers.Embedding` subclass) with a
1M x 64 table and a 1 GiB budget: the table's weights and Adam's two slots
(3 x 1M x 64 x 4 bytes, 732.4 MiB) exceed half the budget, so `place` must
pin the table to the host and say so (it used to pin nothing and say that
"the compute-heavy layers themselves do not fit"). keras-rs's
`DistributedEmbedding` (its table a weight of a nested layer) was placed
correctly before and still is. The reference for the outputs is the same
model unplaced with the same weights. Runs in the hub leg (keras-rs
installed) with /CPU:1 standing in for the accelerator (`two_devices`, see
conftest.py).
"""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest

pytestmark = [
    pytest.mark.two_devices,
    pytest.mark.tensorflow(reason="place pins variables and calls with tf.device"),
    pytest.mark.skipif(
        importlib.util.find_spec("keras_rs") is None,
        reason=f"keras-rs is not installed for {sys.executable} (the hub CI leg installs "
        "it: pip install keras-rs)",
    ),
]

HOST, ACC = "/CPU:0", "/CPU:1"
ROWS, DIM, SEQ = 1_000_000, 64, 8
BUDGET = 2**30
TABLE_AND_SLOTS_MIB = 3 * ROWS * DIM * 4 / 2**20  # weights + Adam's m and v: 732.4


def _model(kind: str):
    import keras
    import keras_rs

    keras.utils.set_random_seed(0)
    ids = keras.Input((SEQ,), dtype="int32")
    if kind == "EmbedReduce":
        h = keras_rs.layers.EmbedReduce(ROWS, DIM, combiner="sum", name="table")(ids)
    else:
        table = keras_rs.layers.TableConfig(
            name="t", vocabulary_size=ROWS, embedding_dim=DIM, combiner="sum")
        feature = keras_rs.layers.FeatureConfig(
            name="f", table=table, input_shape=(None, SEQ), output_shape=(None, DIM))
        h = keras_rs.layers.DistributedEmbedding(feature, name="table")(ids)
    out = keras.layers.Dense(4, name="head")(keras.layers.Dense(32, name="hidden")(h))
    model = keras.Model(ids, out)
    model.compile(optimizer="adam", loss="mse")
    return model


@pytest.mark.parametrize("kind", ["EmbedReduce", "DistributedEmbedding"])
def test_keras_rs_tables_are_pinned_with_a_true_reason(kind):
    from keras_memfit.placement import place

    model, reference = _model(kind), _model(kind)
    reference.set_weights(model.get_weights())
    plan = place(model, budget=BUDGET, accelerator=ACC)
    assert plan.applied and plan.cpu_layers == ["table"], plan.reason
    assert f"({TABLE_AND_SLOTS_MIB:.1f} MiB) exceed 50% of the budget (512.0 MiB)" in plan.reason
    assert "pinned the cheap layers" in plan.reason and "(table)" in plan.reason, plan.reason
    assert "do not fit" not in plan.reason, plan.reason
    (table,) = model.get_layer("table").weights
    assert tuple(table.shape) == (ROWS, DIM)
    assert table.value.device.endswith("CPU:0"), table.value.device
    for layer in ("hidden", "head"):
        assert all(w.value.device.endswith("CPU:1") for w in model.get_layer(layer).weights)
    x = np.random.default_rng(0).integers(0, ROWS, (16, SEQ)).astype("int32")
    np.testing.assert_allclose(
        model.predict(x, verbose=0), reference.predict(x, verbose=0), rtol=1e-6, atol=1e-6)
