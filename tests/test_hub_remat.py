"""MemFit's remat rung on a KerasHub causal LM: one sample that plain Keras cannot train, exact.

Issue 37's hub test. A `GemmaCausalLM` from a small config (4 decoder
blocks, hidden 128, random weights, nothing downloaded) with LoRA
(`enable_lora(4)`), one sample of `LENGTH` tokens per batch, on
TensorFlow's BFC CPU allocator capped at `CAP_MB` (a real, recoverable
OOM). Measured peaks of one sample (the allocator's statistics, uncapped):
plain Keras 122 MiB; with 1, 2, 4 decoder blocks recomputed 101, 77,
50 MiB. Under caps (this script, after the `remat=False` try): plain Keras
fails at 90 MiB and trains at 110; 1 block recomputed fails at 80, trains
at 90; 2 train at 70. At the cap of 70, far below what plain Keras needs,
`MemFit(remat=False)` raises the one-sample error, and `MemFit()`
recomputes blocks (the backbone's decoder blocks, one level below the task
model's top: the backbone recomputed whole would free nothing at its
backward pass's peak), 1 then 2 (4 if 2 ever fall short), and trains. The
reference is plain `fit` of the same seeded model
without the cap, in a child of its own; the LoRA weights, every other
weight, Adam's variables and History must match it.

TensorFlow only: its real limit is TensorFlow's capped allocator (the
blocks are found on JAX too, traced at the batch's sequence length, which
Gemma leaves unknown).

Run directly, this file is the test's training script:
`python tests/test_hub_remat.py {capped,plain} OUT`.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests.generate_support import gemma_lora_lm, requires_hub  # noqa: E402

pytestmark = requires_hub

LENGTH, VOCAB, ROWS = 1024, 1000, 2
CAP_MB = 70  # plain Keras fails at 90 MiB; 2 blocks recomputed train at 70, all 4 need 50
WEIGHT_TOL = dict(rtol=0, atol=1e-6)


def _gemma():
    return gemma_lora_lm(4, VOCAB)


def _fit(model, callbacks):
    rng = np.random.default_rng(1)
    tokens = rng.integers(1, VOCAB, (ROWS, LENGTH + 1)).astype("int32")
    mask = np.ones((ROWS, LENGTH), bool)
    x = {"token_ids": tokens[:, :-1], "padding_mask": mask}
    return model.fit(x, tokens[:, 1:], sample_weight=mask, batch_size=1, epochs=1,
                     shuffle=False, verbose=0, callbacks=callbacks)


@pytest.mark.tensorflow(reason="TensorFlow's capped CPU allocator makes the OOM")
def test_gemma_lora_one_sample_trains_under_memfit_as_plain_fit(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from tests.child import run_child

    def run(mode):
        env = {k: v for k, v in os.environ.items() if not k.startswith("TF_CPU_")}
        env.update(TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="2",
                   KERAS_BACKEND="tensorflow", PYTHONPATH=ROOT)
        if mode == "capped":
            env.update(TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPU_BFC_MEM_LIMIT_IN_MB=str(CAP_MB))
        out = str(tmp_path / mode)
        proc = run_child([os.path.abspath(__file__), mode, out], env=env, timeout=500)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        with open(out + ".json") as f:
            result = json.load(f)
        with np.load(out + ".npz") as arrays:
            state = [arrays[f"v{i}"] for i in range(len(arrays.files))]
        return state, result

    with ThreadPoolExecutor(2) as pool:  # the reference runs while the capped run waits
        (state, got), (ref_state, expected) = pool.map(run, ["capped", "plain"])
    assert got["off"].startswith("OutOfMemoryError") and "single sample" in got["off"], got["off"]
    remat = [e for e in got["events"] if e["kind"] == "remat"]
    print("events:", got["events"])
    assert remat, got["events"]
    layers = remat[-1]["layers"]
    assert layers and all(name.startswith("decoder_block_") for name in layers), layers
    assert got["history"]["memfit_remat"] == [len(layers)]
    for key, values in expected["history"].items():
        np.testing.assert_allclose(got["history"][key], values, err_msg=key, rtol=1e-5)
    weights = expected["weights"]  # then Adam's variables (named after its instance)
    assert got["paths"][:weights] == expected["paths"][:weights] and len(state) == len(ref_state)
    for i, (path, value, want) in enumerate(zip(expected["paths"], state, ref_state)):
        if i < weights:
            np.testing.assert_allclose(value, want, err_msg=path, **WEIGHT_TOL)
        else:  # Adam's slots, to 1e-4 of the slot's largest entry: the recomputed graph
            # rounds the LoRA A factors' gradient (a sum over the tokens that nearly
            # cancels: ~1e-11 where the slot's entries reach ~1e-6) differently.
            atol = max(1e-4 * float(np.max(np.abs(want), initial=0.0)), 1e-12)
            np.testing.assert_allclose(value, want, err_msg=path, rtol=1e-4, atol=atol)
    # Only LoRA weights trained (the B factors: A's gradient is zero while B is zeros).
    assert got["changed"] == expected["changed"], (got["changed"], expected["changed"])
    assert expected["changed"] and all("lora" in p for p in expected["changed"]), expected["changed"]


def _main(mode: str, out: str) -> None:
    """Train `ROWS` samples one per batch; write the weights, Adam's variables, History
    and MemFit's events (`mode` "capped": after `MemFit(remat=False)` failed there)."""
    import keras

    from keras_memfit import MemFit, OutOfMemoryError

    result = {}
    if mode == "capped":
        try:  # without the rung, MemFit gives up at one sample
            _fit(_gemma(), [MemFit(remat=False)])
            result["off"] = "trained"
        except OutOfMemoryError as err:
            result["off"] = f"OutOfMemoryError: {err}"
    model = _gemma()
    initial = [keras.ops.convert_to_numpy(v) for v in model.weights]
    memfit = MemFit()
    history = _fit(model, [memfit] if mode == "capped" else [])
    variables = list(model.weights) + list(model.optimizer.variables)
    changed = [v.path for v, value in zip(model.weights, initial)
               if not np.array_equal(keras.ops.convert_to_numpy(v), value)]
    result.update(history=history.history, events=memfit.events, weights=len(model.weights),
                  paths=[v.path for v in variables], changed=changed)
    np.savez(out + ".npz", **{f"v{i}": keras.ops.convert_to_numpy(v)
                              for i, v in enumerate(variables)})
    with open(out + ".json", "w") as f:
        json.dump(result, f, default=str)


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
