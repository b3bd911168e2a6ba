"""Tiny KerasHub causal LMs built from config (random weights, nothing downloaded).

`requires_hub` skips a test where keras-hub is not installed (the CI legs
without the `hub` extra), with that reason.
"""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest

HUB_AVAILABLE = importlib.util.find_spec("keras_hub") is not None
requires_hub = pytest.mark.skipif(
    not HUB_AVAILABLE,
    reason=f"keras-hub is not installed for {sys.executable}; safe_generate and the "
    "reports of KerasHub models need it (pip install -e '.[hub]'; the CI leg that "
    "installs the hub extra runs these tests)",
)

# Words of the in-memory GPT-2 vocabulary ("Ġ" marks a leading space).
_WORDS = ["a", "b", "c", "d", "e", "f", "g", "h"]


def gpt2_lm(preprocessor: bool = True, vocabulary_size: int = 64, seq: int = 16,
            hidden: int = 16, layers: int = 2, heads: int = 2):
    """A GPT-2 causal LM from a tiny config, greedy sampler, seeded.

    With `preprocessor`, a GPT-2 tokenizer on an in-memory vocabulary (single
    letters, with and without a leading space) and `sequence_length=seq`:
    the model takes and returns strings; without, token ids.
    """
    import keras
    import keras_hub

    keras.utils.set_random_seed(0)
    pre = None
    if preprocessor:
        vocab = {"<|endoftext|>": 0}
        for word in _WORDS:
            vocab[word] = len(vocab)
            vocab["Ġ" + word] = len(vocab)
        vocab["Ġ"] = len(vocab)
        merges = ["Ġ " + w for w in _WORDS]
        tokenizer = keras_hub.models.GPT2Tokenizer(vocabulary=vocab, merges=merges)
        pre = keras_hub.models.GPT2CausalLMPreprocessor(tokenizer=tokenizer, sequence_length=seq)
        vocabulary_size = len(vocab)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=vocabulary_size, num_layers=layers, num_heads=heads,
        hidden_dim=hidden, intermediate_dim=4 * hidden, max_sequence_length=max(seq, 16),
    )
    lm = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=pre)
    lm.compile(sampler="greedy")
    return lm


def gemma_lora_lm(layers: int, vocabulary_size: int):
    """A Gemma causal LM from a small config (hidden 128), seeded, with LoRA
    (`enable_lora(4)`: only the LoRA weights train), compiled with Adam."""
    import keras
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=vocabulary_size, num_layers=layers, num_query_heads=2,
        num_key_value_heads=1, hidden_dim=128, intermediate_dim=256, head_dim=64, dropout=0.0)
    lm = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    backbone.enable_lora(4)
    lm.compile(optimizer=keras.optimizers.Adam(1e-3),
               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
               weighted_metrics=[])
    return lm


def prompts(n: int, seed: int = 0):
    """`n` prompts of 1 to 4 words of the vocabulary."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(_WORDS, rng.integers(1, 5))) for _ in range(n)]


def token_prompts(n: int, seq: int, vocabulary_size: int, lengths=(2, 6), seed: int = 0):
    """`n` token-id prompts of `lengths` tokens padded to `seq` (a dict generate takes)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, vocabulary_size, (n, seq)).astype("int32")
    lens = rng.integers(lengths[0], lengths[1], n)
    mask = np.arange(seq)[None] < lens[:, None]
    return {"token_ids": np.where(mask, ids, 0), "padding_mask": mask}


def generate_in_batches(lm, x, batch, **kwargs):
    """`lm.generate` on consecutive batches of `batch` prompts, joined (the reference)."""
    if isinstance(x, dict):
        n = len(next(iter(x.values())))
        parts = [lm.generate({k: v[i:i + batch] for k, v in x.items()}, **kwargs)
                 for i in range(0, n, batch)]
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    out = []
    for i in range(0, len(x), batch):
        out.extend(lm.generate(list(x[i:i + batch]), **kwargs))
    return out
