"""`safe_generate` under a real memory limit where `generate` on all the prompts fails.

On JAX's CPU client under an address-space limit (tests/jax_support.py):
TensorFlow's capped CPU allocator segfaulted in KerasHub's generate loop
(2048 prompts under 400 MB), where JAX raises a recoverable
RESOURCE_EXHAUSTED. keras_hub imports TensorFlow even on JAX: about 2 GB of
address space before anything runs, 3.2 GB once a first generate has
compiled; the limit, 4 GB, leaves under 1 GB for the batch. The 2048
prompts (GPT-2, 128 tokens, hidden 128) need about 1.6 GB in one piece;
a quarter fits. The prompts are 124 to 126 tokens long, so generate runs
few steps (the test takes about a minute).
"""

from __future__ import annotations

from tests.generate_support import requires_hub
from tests.jax_support import requires_jax, run_in_jax

LIMIT_GB = 4
ROWS, SEQ, VOCAB = 2048, 128, 512


@requires_hub
@requires_jax
def test_safe_generate_under_a_real_limit():
    output = run_in_jax(__file__, "child_real_limit", address_space_gb=LIMIT_GB)
    assert "plain generate: out of memory" in output, output[-3000:]
    ooms = output.count("out of memory at batch_size=")  # the keras_memfit logger's WARNINGs
    assert 1 <= ooms <= 3, output[-3000:]


def child_real_limit():
    import numpy as np

    from keras_memfit import is_oom_error, safe_generate
    from tests.generate_support import generate_in_batches, gpt2_lm, token_prompts

    lm = gpt2_lm(preprocessor=False, vocabulary_size=VOCAB, seq=SEQ, hidden=128, heads=4)
    x = token_prompts(ROWS, SEQ, VOCAB, lengths=(SEQ - 4, SEQ - 1))
    try:
        lm.generate(x, stop_token_ids=None)
    except Exception as err:  # noqa: BLE001 - the point: it runs out of memory
        assert is_oom_error(err), err
        print("plain generate: out of memory:", str(err)[:120])
    else:
        raise AssertionError(f"generate on {ROWS} prompts fitted under {LIMIT_GB} GB")
    got = safe_generate(lm, x, stop_token_ids=None)
    expected = generate_in_batches(lm, x, 64, stop_token_ids=None)  # a batch that fits
    for key in expected:
        np.testing.assert_array_equal(got[key], expected[key])
