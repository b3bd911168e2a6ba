"""Keras's step functions in the JAX trainer's calling convention.

Keras's JAX trainer calls `model.train_function(state, iterator)` (and `test_function`,
`predict_function` likewise), `state` being the tuple of variable-value lists it detached from
the variables at the start of the epoch (`_purge_model_variables`) and threads from step to
step; it expects `(result, state)` back and writes the last state into the variables at the
end (`jax_state_sync`). `step_function` runs keras_memfit's steps on that tuple itself
(`state.threaded`); what can run out of memory in them donates nothing of it, so whatever
they raise, the state Keras holds is whole.

Under several JAX processes the function hands `run_batches` this process's own rows, and a
process whose function raises tells the others (`processes.post_failure`) first.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable, Iterator, List

import keras

from keras_memfit._internal import batches as _batches
from keras_memfit.backend.base import check_step_kind
from keras_memfit.backend.jax import processes as _processes
from keras_memfit.backend.jax import state as _state


_STATE_KEYS = {
    "train": ("trainable_variables", "non_trainable_variables", "optimizer_variables",
              "metrics_variables"),
    "test": ("trainable_variables", "non_trainable_variables", "metrics_variables"),
    "predict": ("trainable_variables", "non_trainable_variables"),
}


def _publish(model: keras.Model, kind: str, state: tuple) -> None:
    """Make `state` the one Keras's `jax_state_sync` writes back.

    Keras sets the trainer's `_jax_state` only after the step function returned, so a sync in
    between (a callback reading `Callback.model`; Keras's closing sync after a raise) would write
    an older state. Set here also when `run_batches` raised (the pieces that succeeded are kept)
    or the trainer has none yet, and without Keras's attribute tracking, which wraps the lists.
    """
    object.__setattr__(model, "_jax_state", dict(zip(_STATE_KEYS[kind], state)))


def step_function(
    model: keras.Model,
    kind: str,
    run_batches: Callable[[Iterable[Any]], Any],
) -> Callable[[Any, Any], Any]:
    """`function(state, iterator) -> (result, state)`, pulling up to `model.steps_per_execution`
    batches, one at a time (StopIteration when none is left)."""
    check_step_kind(kind)
    model_ref = weakref.ref(model)
    groups = _state.GROUPS[kind]
    several = _processes.multi_process()

    def function(state, iterator):
        model = model_ref()
        if len(state) != len(groups):
            raise ValueError(
                f"keras_memfit's {kind}_function expects Keras's JAX {kind} state of "
                f"{len(groups)} variable lists; received {len(state)}"
            )
        with _state.threaded(model, kind, state) as call:
            try:
                batches = _batches.pull_batches(
                    iterator, model.steps_per_execution, is_end_of_data)
                if several:  # each process runs its own rows (see `processes`)
                    batches = (_processes.local_rows(batch) for batch in batches)
                result = run_batches(batches)
            except Exception as exc:
                if several and not is_end_of_data(exc):
                    _processes.post_failure(exc)  # the other processes stop at once
                raise
            finally:
                state = call.finish()
                _publish(model, kind, state)
        return result, state

    return function


def adapter_batches(adapter: Any) -> Iterator[Any]:
    """Keras's own JAX iterator (sparse matrices as JAX `BCOO` arrays)."""
    return iter(adapter.get_jax_iterator())


def call_keras_function(
    model: keras.Model, kind: str, function: Callable[..., Any], batches: List[Any]
) -> Any:
    """Keras's function on the state MemFit's function holds (`state.get`), its new state put back.

    Keras's function donates the state: an OOM in it loses the state, as it does without MemFit.
    """
    names = _state.GROUPS[kind]
    state = tuple(_state.get(model, names))
    result, new_state = function(state, iter(batches))
    _state.put(model, names, new_state)
    return result


def is_end_of_data(exc: BaseException) -> bool:
    return isinstance(exc, StopIteration)


materialize = _state.materialize
