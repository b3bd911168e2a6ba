"""`safe_generate` under a real memory limit where `generate` on all the prompts fails.

On JAX's CPU client under an address-space limit (tests/jax_support.py):
TensorFlow's capped CPU allocator segfaulted in KerasHub's generate loop
(2048 prompts under 400 MB), where JAX raises a recoverable
RESOURCE_EXHAUSTED. keras_hub imports TensorFlow even on JAX: about 2 GB of
address space before anything runs, 3.2 GB once a first generate has
compiled; the limit, 4 GB, leaves under 1 GB for the batch. safe_generate
runs twice: with the limit known (sized from it and the analytic estimate,
no OOM), then with it hidden, as where no limit is known, recovering from
real OOMs. The 2048
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
    line = next(line for line in output.splitlines() if line.startswith("OOMS "))
    ooms = [int(n) for n in line.split()[1:]]  # with the limit known, then hidden
    print(f"safe_generate paid {ooms} OOMs (limit known, hidden)")
    assert ooms[0] <= 1, output[-3000:]  # sized from the limit and the analytic estimate
    assert 1 <= ooms[1] <= 4, output[-3000:]  # recovered from real OOMs (3 measured)


def child_real_limit():
    import numpy as np

    from keras_memfit import is_oom_error, safe_generate
    from keras_memfit.planning import knowledge as records
    from tests.jax_support import hide_address_space_limit
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
    warnings = _OomWarnings()
    got = safe_generate(lm, x, stop_token_ids=None)
    known = warnings.count
    expected = generate_in_batches(lm, x, 64, stop_token_ids=None)  # a batch that fits
    for key in expected:
        np.testing.assert_array_equal(got[key], expected[key])
    # Again with the limit hidden (and nothing remembered): it must meet real OOMs.
    records.forget(lm)
    hide_address_space_limit()
    got = safe_generate(lm, x, stop_token_ids=None)
    for key in expected:
        np.testing.assert_array_equal(got[key], expected[key])
    print(f"OOMS {known} {warnings.count - known}", flush=True)


def _OomWarnings():
    """A handler on the keras_memfit logger counting its OOM WARNINGs (`.count`)."""
    import logging

    class Handler(logging.Handler):
        count = 0

        def emit(self, record):
            if "out of memory at batch_size=" in record.getMessage():
                self.count += 1

    handler = Handler(logging.WARNING)
    logging.getLogger("keras_memfit").addHandler(handler)
    return handler
