"""`place` recognises a lookup by what it is, not by its class name.

keras-rs's `EmbedReduce` (a `keras.layers.Embedding` subclass that sums the
rows it looks up) and KerasHub's `ReversibleEmbedding` are lookups whose names
are not "Embedding". The reference is the plain `Embedding` of the same size:
both must be pinned to the host under the same budget, with a reason that
says what happened. Runs with /CPU:1 standing in for the accelerator
(`two_devices`, see conftest.py).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

from keras_memfit.placement import place

pytestmark = pytest.mark.two_devices

HOST, ACC = "/CPU:0", "/CPU:1"
ROWS, DIM, SEQ = 200_000, 16, 8


class EmbedReduce(keras.layers.Embedding):
    """As keras-rs's: the looked-up rows of each sample, summed."""

    def call(self, inputs):
        return keras.ops.sum(super().call(inputs), axis=1)

    def compute_output_shape(self, input_shape):
        return (input_shape[0], self.output_dim)


def _model(table: keras.layers.Layer) -> keras.Model:
    ids = keras.Input((SEQ,), dtype="int32")
    h = table(ids)
    if len(h.shape) == 3:
        h = keras.layers.GlobalAveragePooling1D()(h)
    out = keras.layers.Dense(4, name="head")(keras.layers.Dense(32, name="hidden")(h))
    model = keras.Model(ids, out)
    model.compile(optimizer="adam", loss="mse")
    return model


@pytest.mark.parametrize("table", ["Embedding", "EmbedReduce"])
def test_an_embedding_subclass_is_pinned_as_the_embedding_is(table):
    layer = {"Embedding": keras.layers.Embedding, "EmbedReduce": EmbedReduce}[table]
    model = _model(layer(ROWS, DIM, name="table"))
    plan = place(model, budget=10_000_000, accelerator=ACC)
    assert plan.applied and plan.cpu_layers == ["table"], plan.reason
    assert "pinned the cheap layers" in plan.reason and "(table)" in plan.reason, plan.reason
    assert "do not fit" not in plan.reason, plan.reason
    table_var = model.get_layer("table").embeddings
    assert table_var.value.device.endswith("CPU:0")
    assert all(v.value.device.endswith("CPU:1") for v in model.get_layer("head").weights)
    x = np.random.default_rng(0).integers(0, ROWS, (16, SEQ)).astype("int32")
    assert model.predict(x, verbose=0).shape == (16, 4)
