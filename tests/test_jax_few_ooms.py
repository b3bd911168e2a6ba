"""On JAX's CPU client a call pays at most 2 OOMs, with the limit known or not (issue 21, item 3).

The seed's predict (the digit CNN, 28,000 images of 28x28x1 at
`batch_size=28000`, several GB of activations) and a fit (MemFit on
`real_oom_model`, batches of 8,192 rows) run in a child under a 1.9 GB
address-space limit (JAX's own address space is about 1.6 GB of it), where
the plain Keras call at the full batch runs out of memory. Twice each: with
the limit known (`RLIMIT_AS`, which keras_memfit reads as the CPU's limit:
sized from it, no OOM measured) and with it hidden, as on a platform whose
`memory_stats()` is empty, where each OOM used to halve the batch (3 OOMs
measured on the seed's predict at this limit, 5 in the issue) and now
shrinks to an eighth of the failed size's estimated need
(`planning/shape_plan.blind_size`). The references are plain Keras at a
batch that fits (predict) and the same fit run without the limit (fit).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.jax_support import OOMCounter, hide_address_space_limit, real_oom_model, requires_jax, run_in_jax

pytestmark = requires_jax

LIMIT_GB = 1.9
SEED_ROWS, SEED_ORACLE_BATCH = 28000, 256
FIT_ROWS, FIT_BATCH = 16384, 8192


def _hidden() -> bool:
    if os.environ.get("MEMFIT_HIDE_LIMIT"):
        hide_address_space_limit()
        return True
    return False


def child_seed_predict():
    import keras

    import keras_memfit
    from keras_memfit.app.demo import build_cnn

    hidden = _hidden()
    keras.utils.set_random_seed(0)
    model = build_cnn()
    x = np.random.default_rng(0).random((SEED_ROWS, 28, 28, 1), dtype=np.float32)
    expected = model.predict(x, batch_size=SEED_ORACLE_BATCH, verbose=0)
    ooms = OOMCounter()
    result = keras_memfit.safe_predict(model, x, batch_size=SEED_ROWS, verbose=0)
    np.testing.assert_allclose(result, expected, rtol=1e-5, atol=1e-6)
    print(f"seed predict: {ooms.count} OOMs (limit hidden: {hidden})")
    assert ooms.count <= 2, ooms.count
    assert ooms.count >= 1 or not hidden, "no OOM with the limit hidden: the test proves nothing"
    # (Last: a failed plain predict can leave memory held, as the first call after it.)
    try:  # the full batch does not fit: the call had to adapt
        model.predict(x, batch_size=SEED_ROWS, verbose=0)
        model.get_weights()
        raise AssertionError("plain predict at the full batch fitted: the limit is too high")
    except Exception as err:  # noqa: BLE001
        assert keras_memfit.is_oom_error(err), str(err)[:300]


def _fit(model, callbacks=()):
    rng = np.random.default_rng(0)
    x, y = rng.random((FIT_ROWS, 8), dtype=np.float32), rng.integers(0, 3, FIT_ROWS)
    model.fit(x, y, batch_size=FIT_BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=list(callbacks))


def child_fit_reference():
    """Plain fit at the full batch, without the limit: the weights MemFit must reach."""
    model = real_oom_model()
    _fit(model)
    np.savez(os.environ["MEMFIT_REFERENCE"], *model.get_weights())


def child_fit():
    import keras_memfit

    hidden = _hidden()
    model = real_oom_model()
    ooms = OOMCounter()
    memfit = keras_memfit.MemFit()
    _fit(model, [memfit])
    print(f"fit: {ooms.count} OOMs (limit hidden: {hidden}), "
          f"events {[(e['kind'], e['old_size'], e['new_size']) for e in memfit.events]}")
    assert memfit.events, "MemFit did not adapt: the test proves nothing"
    assert ooms.count <= 2, ooms.count
    assert ooms.count >= 1 or not hidden, "no OOM with the limit hidden: the test proves nothing"
    assert int(model.optimizer.iterations.value) == FIT_ROWS // FIT_BATCH
    reference = np.load(os.environ["MEMFIT_REFERENCE"])
    for i, weight in enumerate(model.get_weights()):
        np.testing.assert_allclose(weight, reference[f"arr_{i}"], rtol=1e-4, atol=1e-5)


LIMIT_STATES = {"limit known": {}, "limit hidden": {"MEMFIT_HIDE_LIMIT": "1"}}


@pytest.mark.parametrize("state", list(LIMIT_STATES))
def test_the_seed_predict_pays_at_most_two_ooms(state):
    output = run_in_jax(__file__, "child_seed_predict", address_space_gb=LIMIT_GB,
                        env=LIMIT_STATES[state])
    print(next(line for line in output.splitlines() if line.startswith("seed predict:")))


def test_a_memfit_fit_with_the_limit_hidden_pays_at_most_two_ooms(tmp_path):
    env = {"MEMFIT_REFERENCE": str(tmp_path / "reference.npz")}
    run_in_jax(__file__, "child_fit_reference", env=env)
    output = run_in_jax(__file__, "child_fit", address_space_gb=LIMIT_GB,
                        env={**env, **LIMIT_STATES["limit hidden"]})
    print(next(line for line in output.splitlines() if line.startswith("fit:")))
