"""On JAX, safe_predict and MemFit compile few shapes and pay at most 2 OOMs per call.

Each new piece size compiles the step again (XLA), so the bounds are
against the oracle, plain Keras at a batch that fits, counted with the same
counter (`tests/compile_count.py`) in the same child process: safe_predict's
first call at most one compilation more than `model.predict`, its second
call none; MemFit at most two more than plain `fit` over a fit that adapts.
Each child runs under an address-space limit (`tests/jax_support.py`), so
the full batch really runs out of memory.
"""

from __future__ import annotations

import logging
import os

import numpy as np

from tests.jax_support import OOMCounter, real_oom_model, requires_jax, run_in_jax

pytestmark = requires_jax

LIMIT_GB = 1.9  # JAX's own address space is about 1.6 GB: a few hundred MB for the batch
# One malloc arena: glibc's per-thread arenas reserve address space the limit
# counts, a varying amount, which would make the planner's estimate (from the
# limit) miss now and then, each miss a compilation more.
ONE_ARENA = {"MALLOC_ARENA_MAX": "1"}
ROWS = 28000  # the seed's predict: 28,000 rows at batch_size=28000 (1.8 GB of activations)
ORACLE_BATCH = 1024
FIT_ROWS, FIT_BATCH, FIT_ORACLE_BATCH = 16384, 8192, 512


def _data(rows):
    rng = np.random.default_rng(0)
    return rng.random((rows, 8), dtype=np.float32), rng.integers(0, 3, rows)


def child_predict():
    import keras_memfit
    from tests.compile_count import JaxCompiles

    x, _ = _data(ROWS)
    model = real_oom_model()
    with JaxCompiles() as oracle:
        expected = model.predict(x, batch_size=ORACLE_BATCH, verbose=0)
    try:  # the full batch does not fit: the call must adapt
        model.predict(x, batch_size=ROWS, verbose=0)
        model.get_weights()
        raise AssertionError("plain predict at the full batch fitted: the limit is too high")
    except Exception as err:  # noqa: BLE001
        assert keras_memfit.is_oom_error(err), str(err)[:300]
    model = real_oom_model()
    for call, most in ((1, oracle.count + 1), (2, 0)):
        ooms = OOMCounter()
        with JaxCompiles() as compiles:
            result = keras_memfit.safe_predict(model, x, batch_size=ROWS, verbose=0)
        np.testing.assert_allclose(result, expected, rtol=1e-5, atol=1e-6)
        print(f"call {call}: {compiles.count} compilations (oracle {oracle.count}), "
              f"{ooms.count} OOMs")
        assert compiles.count <= most, (call, compiles.count, oracle.count)
        assert ooms.count <= 2, (call, ooms.count)
        logging.getLogger("keras_memfit").removeHandler(ooms)


def _fit(model, batch_size, callbacks=()):
    x, y = _data(FIT_ROWS)
    return model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0,
                     callbacks=list(callbacks))


def child_fit_reference():
    """Plain fit at the full batch, without the limit: the weights MemFit must reach."""
    model = real_oom_model()
    _fit(model, FIT_BATCH)
    np.savez(os.environ["MEMFIT_REFERENCE"], *model.get_weights())


def child_fit():
    import keras_memfit
    from tests.compile_count import JaxCompiles

    oracle_model = real_oom_model()  # built outside the count, as MemFit's model
    with JaxCompiles() as oracle:
        _fit(oracle_model, FIT_ORACLE_BATCH)
    model = real_oom_model()
    ooms = OOMCounter()
    memfit = keras_memfit.MemFit()
    with JaxCompiles() as compiles:
        _fit(model, FIT_BATCH, [memfit])
    print(f"fit: {compiles.count} compilations (oracle {oracle.count}), {ooms.count} OOMs, "
          f"events {[(e['kind'], e['old_size'], e['new_size']) for e in memfit.events]}")
    assert memfit.events, "MemFit did not adapt: the test proves nothing"
    assert int(model.optimizer.iterations.value) == FIT_ROWS // FIT_BATCH
    assert compiles.count <= oracle.count + 2, (compiles.count, oracle.count)
    assert ooms.count <= 2, ooms.count
    reference = np.load(os.environ["MEMFIT_REFERENCE"])
    for i, weight in enumerate(model.get_weights()):
        np.testing.assert_allclose(weight, reference[f"arr_{i}"], rtol=1e-4, atol=1e-5)


def test_safe_predict_compiles_at_most_one_shape_more_than_keras():
    output = run_in_jax(__file__, "child_predict", address_space_gb=LIMIT_GB, env=ONE_ARENA)
    assert "call 2: 0 compilations" in output


def test_memfit_compiles_at_most_two_shapes_more_than_keras(tmp_path):
    env = {"MEMFIT_REFERENCE": str(tmp_path / "reference.npz")}
    run_in_jax(__file__, "child_fit_reference", env=env)
    output = run_in_jax(__file__, "child_fit", address_space_gb=LIMIT_GB,
                        env={**env, **ONE_ARENA})
    assert "fit:" in output
