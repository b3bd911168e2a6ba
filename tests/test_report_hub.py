"""`memory_report` on KerasHub and keras-rs models (tiny configs built from config).

The shapes are checked against the configs' arithmetic; the peak estimate
against TensorFlow's measured peak (benchmarks/hub_report.py, whose figures
are in benchmarks/RESULTS.md, section hub-report).
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.generate_support import requires_hub

pytestmark = requires_hub

SEQ, HIDDEN, BATCH = 64, 32, 4


def _gpt2_backbone():
    import keras_hub

    return keras_hub.models.GPT2Backbone(
        vocabulary_size=100, num_layers=1, num_heads=2, hidden_dim=HIDDEN,
        intermediate_dim=2 * HIDDEN, max_sequence_length=SEQ)


def _gemma_backbone():
    import keras_hub

    return keras_hub.models.GemmaBackbone(
        vocabulary_size=100, num_layers=1, num_query_heads=2, num_key_value_heads=1,
        hidden_dim=HIDDEN, intermediate_dim=2 * HIDDEN, head_dim=16)


def _embedding_row(report):
    (row,) = [r for r in report.rows if r.name == "token_embedding"]
    return row


def test_backbone_tokens_sized_at_max_sequence_length():
    from keras_memfit import memory_report

    row = _embedding_row(memory_report(_gpt2_backbone(), BATCH, training=False))
    assert tuple(row.output_shape) == (SEQ, HIDDEN)
    assert row.activation_bytes == 4 * BATCH * SEQ * HIDDEN


def test_sequence_length_given():
    from keras_memfit import memory_report

    bb = _gemma_backbone()  # no max_sequence_length: the tokens stay unknown
    unknown = memory_report(bb, BATCH, training=False)
    given = memory_report(bb, BATCH, training=False, sequence_length=48)
    assert tuple(_embedding_row(given).output_shape) == (48, HIDDEN)
    assert _embedding_row(given).activation_bytes == 4 * BATCH * 48 * HIDDEN
    assert None in tuple(_embedding_row(unknown).output_shape)
    shorter = memory_report(_gpt2_backbone(), BATCH, training=False, sequence_length=16)
    assert tuple(_embedding_row(shorter).output_shape) == (16, HIDDEN)
    with pytest.raises(ValueError, match="sequence_length=0"):
        memory_report(bb, BATCH, sequence_length=0)


@pytest.mark.tensorflow
@pytest.mark.memory_cap(3000)
@pytest.mark.parametrize("name", ["gpt2", "dcn"])
def test_peak_estimate_against_measured_peak(name):
    if name == "dcn" and importlib.util.find_spec("keras_rs") is None:
        pytest.skip("keras-rs is not installed (pip install keras-rs)")
    from benchmarks.hub_report import child

    result = child(name)
    for phase in ("predict", "train"):
        assert 0.5 <= result[phase]["ratio"] <= 1.3, (name, phase, result)
