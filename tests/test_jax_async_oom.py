"""Why MemFit's JAX train step waits for its gradient program before the update.

`backend/jax/training.TrainStep` runs a gradient program that donates
nothing, waits for it, and only then dispatches the update program that
donates the weights and optimizer variables. The wait costs host time on
every step (RESULTS.md "jax-floor"). It is needed because JAX reports an
out-of-memory error of a program when its outputs are waited for, not when
it is called: a donating program dispatched on the outputs of a program
that then fails takes its donated inputs with it. These tests pin that
behaviour of JAX's CPU client with a real OOM (an address-space limit): if
JAX ever raised such errors at the call, they fail, and the wait could go.

Whether the step waits is read from a table per platform
(`training.OOM_RAISES_AT_DISPATCH`, which the GPU run fills in): the last
tests give the CPU a fake answer both ways and check that the step waits
for its gradient program only where the answer is "at the wait" (or
unknown), and trains the same either way.
"""

from __future__ import annotations

from tests.jax_support import requires_jax, run_in_jax, small_data, small_model

pytestmark = requires_jax

LIMIT_GB = 3  # JAX maps about 1.6 GB; the failing program needs 4 GiB more


def _programs():
    from functools import partial

    import jax
    import jax.numpy as jnp

    def needs(x, n):
        # A sort materialises a temporary of n floats (4n bytes), which XLA cannot fuse away.
        big = jnp.broadcast_to(x, (n // 1024, 1024)) * jnp.arange(
            n // 1024, dtype=jnp.float32)[:, None]
        return jnp.sort(big, axis=0)[:4].sum(0)

    small = jax.jit(partial(needs, n=1 << 20))  # 4 MiB
    huge = jax.jit(partial(needs, n=1 << 30))  # 4 GiB: more than the limit leaves
    update = jax.jit(lambda state, grads: state - 0.1 * grads.sum(), donate_argnums=0)
    return jnp.ones((1024,), jnp.float32), small, huge, update


def child_an_oom_is_reported_when_waited_for_not_at_the_call():
    import keras_memfit

    x, small, huge, _ = _programs()
    small(x).block_until_ready()  # the same program fits at a small size
    outputs = huge(x)  # returns: the failure is not known yet
    try:
        outputs.block_until_ready()
    except Exception as exc:  # noqa: BLE001 - the error being checked
        assert keras_memfit.is_oom_error(exc), exc
    else:
        raise AssertionError("the 4 GiB program did not run out of memory under the limit")


def child_a_donating_program_after_a_failed_one_loses_its_donated_state():
    import jax.numpy as jnp

    x, _, huge, update = _programs()
    state = jnp.ones((1 << 20,), jnp.float32)
    grads = huge(x)  # fails, as above, once waited for
    try:
        update(state, grads).block_until_ready()  # not waited for first: as without the wait
    except Exception:  # noqa: BLE001 - the update fails on its failed input
        pass
    else:
        raise AssertionError("the update ran on the outputs of a program that failed")
    assert state.is_deleted(), "the donated state survived: the wait might not be needed"


def test_an_oom_is_reported_when_waited_for_not_at_the_call():
    run_in_jax(__file__, "child_an_oom_is_reported_when_waited_for_not_at_the_call",
               address_space_gb=LIMIT_GB)


def test_a_donating_program_after_a_failed_one_loses_its_donated_state():
    run_in_jax(__file__, "child_a_donating_program_after_a_failed_one_loses_its_donated_state",
               address_space_gb=LIMIT_GB)


def child_the_cpu_entry_says_at_the_wait():
    from keras_memfit.backend.jax import training

    assert training.OOM_RAISES_AT_DISPATCH["cpu"] is False  # as measured above
    assert training.oom_raises_at_dispatch() is False


def _fit_counting_waits(raises_at_dispatch):
    """A MemFit fit of 10 batches with the CPU's entry set to `raises_at_dispatch`:
    (how many times its steps waited for a gradient program, the weights)."""
    import keras_memfit
    from keras_memfit.backend.jax import training

    waits = []
    wait = training._wait

    def counted(outputs, compiled=True):
        waits.append(compiled)
        wait(outputs, compiled)

    training.OOM_RAISES_AT_DISPATCH["cpu"] = raises_at_dispatch
    training._wait = counted
    try:
        x, y = small_data()
        model = small_model()
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0,
                  callbacks=[keras_memfit.MemFit()])
    finally:
        training._wait = wait
        training.OOM_RAISES_AT_DISPATCH["cpu"] = False
    return len(waits), model.get_weights()


def child_the_step_waits_for_its_gradients_where_the_platform_table_says():
    import numpy as np

    from keras_memfit.backend.jax import training

    at_dispatch, trained = _fit_counting_waits(True)
    assert at_dispatch == 0, f"waited {at_dispatch} times for the gradient program"
    for answer in (False, None):  # None: not measured yet, so the step waits
        at_wait, waited = _fit_counting_waits(answer)
        assert at_wait == 10, (answer, at_wait)  # once per batch
        for got, expected in zip(trained, waited):
            np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
    saved = dict(training.OOM_RAISES_AT_DISPATCH)
    training.OOM_RAISES_AT_DISPATCH.clear()  # a platform the table does not list: waits
    try:
        assert training.oom_raises_at_dispatch() is False
    finally:
        training.OOM_RAISES_AT_DISPATCH.update(saved)


def test_the_cpu_entry_says_at_the_wait():
    run_in_jax(__file__, "child_the_cpu_entry_says_at_the_wait")


def test_the_step_waits_for_its_gradients_where_the_platform_table_says():
    run_in_jax(__file__, "child_the_step_waits_for_its_gradients_where_the_platform_table_says")
