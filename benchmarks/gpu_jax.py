"""The JAX questions of `benchmarks.gpu`, each a scenario run in a child (`benchmarks.gpu_child`).

- "dispatch": does an allocation failure raise at the call (dispatch) or
  only when the result is waited for? Asked of two compiled programs too
  large for the memory left: one whose temporary buffer is (a sort of `n`
  floats, which XLA cannot fuse away), one whose output is. On XLA's CPU
  client both raise at the wait (tests/test_jax_async_oom.py); where they
  raise at dispatch, MemFit's step need not wait for its gradient program
  before the donating update.
- "donation": does a failed program delete its donated inputs? Asked of a
  donating program that itself runs out of memory, and of a donating
  program dispatched on the outputs of a program that failed (MemFit's
  update after its gradient program, without the wait).
- "remat": does Keras's rematerialisation (`keras.RematScope(mode="full")`)
  lower the compiled train step's memory? XLA's buffer analysis of Keras's
  own `train_step`, jitted, on a deep MLP built with and without the scope
  (temporary bytes and peak; nothing runs, nothing is allocated); and with
  the scope, compiled with XLA's `cse_barrier_expander` pass disabled: on
  XLA's CPU client that pass removes the optimization barriers of
  `jax.checkpoint` before CSE merges the recomputation back into the
  forward pass, so remat saves nothing there unless it is disabled.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any, Dict

from benchmarks.gpu_common import error_form


def _needs(x, n: int):
    """A program whose temporary buffer holds `n` floats (4n bytes)."""
    import jax.numpy as jnp

    big = jnp.broadcast_to(x, (n // 1024, 1024)) * jnp.arange(
        n // 1024, dtype=jnp.float32)[:, None]
    return jnp.sort(big, axis=0)[:4].sum(0)


def _outputs(x, n: int):
    """A program whose output holds `n` floats."""
    import jax.numpy as jnp

    return jnp.broadcast_to(x, (n // 1024, 1024)) + 1.0


def _where_it_raises(compiled, *args) -> Dict[str, Any]:
    """Call `compiled` and wait: where its error surfaced ("dispatch", "wait", or "none"), and when."""
    start = time.perf_counter()
    try:
        result = compiled(*args)
    except Exception as err:  # noqa: BLE001 - the outcome being measured
        return {"where": "dispatch", "error": error_form(err),
                "seconds": time.perf_counter() - start}
    try:
        result.block_until_ready()
    except Exception as err:  # noqa: BLE001 - the outcome being measured
        return {"where": "wait", "error": error_form(err),
                "seconds": time.perf_counter() - start}
    return {"where": "none", "error": None, "seconds": time.perf_counter() - start}


def dispatch(huge_floats: int) -> Dict[str, Any]:
    """Where an OOM of a temporary buffer, and of an output, raises (programs compiled first)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((1024,), jnp.float32)
    report = {}
    for name, program in (("temp", _needs), ("output", _outputs)):
        jax.jit(partial(program, n=1 << 20))(x).block_until_ready()  # fits at a small size
        compiled = jax.jit(partial(program, n=huge_floats)).lower(x).compile()
        report[name] = _where_it_raises(compiled, x)
    return report


def donation(huge_floats: int) -> Dict[str, Any]:
    """Whether donated inputs survive a failed program, and a program chained on one."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((1024,), jnp.float32)
    report = {}
    # A donating program that itself runs out of memory.
    state = jnp.ones((1 << 20,), jnp.float32)
    failing = jax.jit(lambda s, x: s + _needs(x, huge_floats).sum(), donate_argnums=0)
    compiled = failing.lower(state, x).compile()
    report["failed"] = dict(_where_it_raises(compiled, state, x),
                            donated_deleted=state.is_deleted())
    # A donating program dispatched on the outputs of a program that failed.
    state = jnp.ones((1 << 20,), jnp.float32)
    huge = jax.jit(partial(_needs, n=huge_floats)).lower(x).compile()
    update = jax.jit(lambda s, g: s - 0.1 * g.sum(), donate_argnums=0)
    try:
        grads = huge(x)
    except Exception:  # noqa: BLE001 - an OOM at dispatch: nothing to chain on
        report["chained"] = {"where": "dispatch", "donated_deleted": state.is_deleted()}
        return report
    report["chained"] = dict(_where_it_raises(update, state, grads),
                             donated_deleted=state.is_deleted())
    return report


KEEP_BARRIERS = {"xla_disable_hlo_passes": "cse_barrier_expander"}


def _remat_step_memory(depth: int, width: int, batch: int, remat: bool,
                       keep_barriers: bool = False) -> Dict[str, int]:
    import contextlib

    import jax
    import keras
    import numpy as np

    keras.utils.set_random_seed(0)
    with keras.RematScope(mode="full") if remat else contextlib.nullcontext():
        layers = [keras.layers.Dense(width, activation="relu") for _ in range(depth)]
        model = keras.Sequential([keras.Input((width,)), *layers, keras.layers.Dense(10)])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(np.ones((2, width), "float32"), np.zeros(2, "int32"), verbose=0)  # builds all
    state = tuple([v.value for v in variables] for variables in (
        model.trainable_variables, model.non_trainable_variables,
        model.optimizer.variables, model.metrics_variables))
    data = (jax.ShapeDtypeStruct((batch, width), "float32"),
            jax.ShapeDtypeStruct((batch,), "int32"))
    options = KEEP_BARRIERS if keep_barriers else None
    compiled = jax.jit(model.train_step, compiler_options=options).lower(state, data).compile()
    analysis = compiled.memory_analysis()
    return {"temp_bytes": int(analysis.temp_size_in_bytes),
            "peak_bytes": int(getattr(analysis, "peak_memory_in_bytes", 0))}


def remat(depth: int, width: int, batch: int) -> Dict[str, Any]:
    """XLA's memory analysis of Keras's train step without and with `RematScope(mode="full")`."""
    return {"plain": _remat_step_memory(depth, width, batch, remat=False),
            "remat": _remat_step_memory(depth, width, batch, remat=True),
            "remat_kept": _remat_step_memory(depth, width, batch, remat=True,
                                             keep_barriers=True)}


SCENARIOS = {"dispatch": dispatch, "donation": donation, "remat": remat}
