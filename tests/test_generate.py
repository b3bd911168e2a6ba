"""`safe_generate` against KerasHub's own `generate` on small batches (tiny GPT-2s)."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from tests.generate_support import (
    HUB_AVAILABLE,
    generate_in_batches,
    gpt2_lm,
    prompts,
    requires_hub,
    token_prompts,
)

# Every test but the missing-keras-hub one needs keras-hub: through these fixtures.


@pytest.fixture(scope="module")
def text_lm():
    if not HUB_AVAILABLE:
        pytest.skip(requires_hub.kwargs["reason"])
    return gpt2_lm(preprocessor=True)


@pytest.fixture(scope="module")
def token_lm():
    if not HUB_AVAILABLE:
        pytest.skip(requires_hub.kwargs["reason"])
    return gpt2_lm(preprocessor=False, vocabulary_size=64, seq=12)


def _record_rows(monkeypatch, lm, fail_above=None):
    """Wrap `lm.generate` to record the rows of each call (and raise MemoryError above)."""
    calls = []
    original = lm.generate

    @functools.wraps(original)
    def generate(inputs, *args, **kwargs):
        leaf = inputs["token_ids"] if isinstance(inputs, dict) else inputs
        rows = len(leaf)
        calls.append(rows)
        if fail_above is not None and rows > fail_above:
            raise MemoryError(f"injected: {rows} prompts")
        return original(inputs, *args, **kwargs)

    monkeypatch.setattr(lm, "generate", generate)
    return calls


def test_strings_equal_generate_on_small_batches(text_lm):
    from keras_memfit import safe_generate

    x = prompts(11)
    # (stop_token_ids=None: this random model's greedy choice is often the end token)
    expected = generate_in_batches(text_lm, x, 2, stop_token_ids=None)
    got = safe_generate(text_lm, x, batch_size=4, stop_token_ids=None)
    assert got == expected
    assert isinstance(got, list) and all(isinstance(s, str) for s in got)
    assert any(g != p for g, p in zip(got, x)), "nothing generated: the test compares prompts"


def test_dataset_equals_generate_on_its_prompts(text_lm):
    import tensorflow as tf

    from keras_memfit import safe_generate

    x = prompts(7, seed=4)
    data = tf.data.Dataset.from_tensor_slices(x).batch(3)
    # (generate on this dataset itself fails in keras-hub 0.32: its tokenizer
    # refuses the bytes a string dataset yields; safe_generate decodes them)
    expected = text_lm.generate(x, stop_token_ids=None)
    assert safe_generate(text_lm, data, batch_size=2, stop_token_ids=None) == expected


def test_single_string_returns_a_string(text_lm):
    from keras_memfit import safe_generate

    assert safe_generate(text_lm, "a b c") == text_lm.generate("a b c")


def test_numpy_strings_and_max_length(text_lm):
    from keras_memfit import safe_generate

    x = prompts(5, seed=1)
    expected = generate_in_batches(text_lm, x, 1, max_length=10, stop_token_ids=None)
    got = safe_generate(text_lm, np.array(x), max_length=10, batch_size=2, stop_token_ids=None)
    assert got == expected


def test_token_ids_equal_generate_on_small_batches(token_lm):
    from keras_memfit import safe_generate

    x = token_prompts(13, 12, 64)
    expected = generate_in_batches(token_lm, x, 3, stop_token_ids=None)
    got = safe_generate(token_lm, x, batch_size=5, stop_token_ids=None)
    assert set(got) == set(expected)
    for key in expected:
        assert got[key].dtype == expected[key].dtype
        np.testing.assert_array_equal(got[key], expected[key])


def test_last_piece_padded_to_a_compiled_shape(monkeypatch, token_lm):
    from keras_memfit import safe_generate

    x = token_prompts(9, 12, 64, seed=2)
    expected = generate_in_batches(token_lm, x, 9, stop_token_ids=None)
    calls = _record_rows(monkeypatch, token_lm)
    got = safe_generate(token_lm, x, batch_size=5, stop_token_ids=None)
    assert calls == [5, 5]  # 5 + 4: the 4 run as 5 (a copy of the last prompt)
    for key in expected:
        np.testing.assert_array_equal(got[key], expected[key])
    calls.clear()  # a second call: 3 + 3 + 3 run as 5, 5, 5 (the shape compiled)
    got = safe_generate(token_lm, x, batch_size=3, stop_token_ids=None)
    assert calls == [5, 5, 5]
    for key in expected:
        np.testing.assert_array_equal(got[key], expected[key])


def test_oom_splits_and_keeps_order(monkeypatch, text_lm):
    from keras_memfit import safe_generate

    x = prompts(10, seed=3)
    expected = generate_in_batches(text_lm, x, 1, stop_token_ids=None)
    calls = _record_rows(monkeypatch, text_lm, fail_above=3)
    got = safe_generate(text_lm, x, stop_token_ids=None)
    assert got == expected
    assert calls[0] == 10  # tried whole first, as generate runs them
    assert len([c for c in calls if c > 3]) <= 3, calls  # few OOMs paid


def test_one_prompt_that_does_not_fit(monkeypatch, text_lm):
    from keras_memfit import OutOfMemoryError, safe_generate

    _record_rows(monkeypatch, text_lm, fail_above=0)
    with pytest.raises(OutOfMemoryError, match="max_length"):
        safe_generate(text_lm, ["a", "b"])


def test_non_oom_errors_pass_through(token_lm):
    from keras_memfit import safe_generate

    x = token_prompts(3, 12, 64)
    with pytest.raises(ValueError, match="preprocessor"):  # generate's own error
        safe_generate(token_lm, x)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"batch_size": 0}, ValueError, "batch_size=0"),
    ({"max_length": -1}, ValueError, "max_length=-1"),
    ({"top_k": 3}, ValueError, "Arguments not recognized.*top_k"),
])
def test_argument_checks_before_any_work(monkeypatch, text_lm, kwargs, error, match):
    from keras_memfit import safe_generate

    calls = _record_rows(monkeypatch, text_lm)
    with pytest.raises(error, match=match):
        safe_generate(text_lm, ["a"], **kwargs)
    assert calls == []


def test_refuses_other_models_and_inputs(text_lm):
    import keras

    from keras_memfit import safe_generate

    with pytest.raises(TypeError, match="keras_hub.models.CausalLM.*received Sequential"):
        safe_generate(keras.Sequential([keras.Input((2,))]), ["a"])
    with pytest.raises(TypeError, match="received int"):
        safe_generate(text_lm, 3)
    with pytest.raises(ValueError, match="one row per prompt"):
        safe_generate(text_lm, {"a": ["x", "y"], "b": ["z"]})


def test_clear_error_without_keras_hub(monkeypatch):  # runs with or without keras-hub
    import importlib.util

    from keras_memfit import safe_generate

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "keras_hub" else real(name, *a))
    with pytest.raises(ImportError, match="pip install keras-hub"):
        safe_generate(object(), ["a"])

