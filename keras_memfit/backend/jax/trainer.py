"""Keras's step functions in the JAX trainer's calling convention.

Keras's JAX trainer calls `model.train_function(state, iterator)` (and
`test_function`, `predict_function` likewise), where `state` is the tuple of
lists of variable values it threads from step to step (train: trainable,
non-trainable, optimizer, metrics; test: trainable, non-trainable, metrics;
predict: trainable, non-trainable), having detached the values from the
model's variables at the start of the epoch (`_purge_model_variables`). It
expects `(result, state)` back, and writes the last state into the variables
at the end of the epoch (`jax_state_sync`).

`step_function` builds a replacement around a backend-neutral
`run_batches(list_of_batches)`: it writes `state` into the model's
variables first (so the model is whole while keras_memfit's steps run, and
stays whole whatever they raise), pulls up to `steps_per_execution` batches,
runs them and returns the result with the variables' new values.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterator, List

import keras

from keras_memfit import _batches
from keras_memfit.backend.jax.steps import assign, values

_KINDS = ("train", "test", "predict")


def next_batches(iterator: Iterator[Any], count: int) -> List[Any]:
    """Up to `count` batches from a Keras epoch iterator (see `_batches.next_batches`)."""
    return _batches.next_batches(iterator, count, is_end_of_data)


def _state_variables(model: keras.Model, kind: str) -> List[List[Any]]:
    groups = [list(model.trainable_variables), list(model.non_trainable_variables)]
    if kind == "train":
        optimizer = model.optimizer.variables if model.optimizer is not None else []
        groups.append(list(optimizer))
    if kind in ("train", "test"):
        groups.append(list(model.metrics_variables))
    return groups


_STATE_KEYS = {
    "train": ("trainable_variables", "non_trainable_variables", "optimizer_variables",
              "metrics_variables"),
    "test": ("trainable_variables", "non_trainable_variables", "metrics_variables"),
    "predict": ("trainable_variables", "non_trainable_variables"),
}


def _publish(model: keras.Model, kind: str, state: tuple) -> None:
    """Make `state` the one Keras's `jax_state_sync` writes back.

    Keras sets the trainer's `_jax_state` only after the step function
    returned; a callback that reads `Callback.model` in between (MemFit
    itself, when it puts Keras's function back) makes Keras write the
    *previous* step's state into the variables. Setting it here first keeps
    every sync current.
    """
    if hasattr(model, "_jax_state"):
        model._jax_state = dict(zip(_STATE_KEYS[kind], state))


def step_function(
    model: keras.Model, kind: str, run_batches: Callable[[List[Any]], Any]
) -> Callable[[Any, Any], Any]:
    """A replacement for `model.<kind>_function` that runs `run_batches`.

    Args:
        model: The model whose function is replaced.
        kind: "train", "test" or "predict".
        run_batches: Runs a list of Keras batches; returns what Keras expects
            of the function (the logs; for "predict", the batches' outputs).

    Returns:
        `function(state, iterator) -> (result, state)`, pulling up to
        `model.steps_per_execution` batches (StopIteration when none is left).

    Raises:
        ValueError: If `kind` is not one of the three.

    Example:
        >>> model.train_function = step_function(model, "train", run.train)
    """
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {list(_KINDS)}; received kind={kind!r}")
    model_ref = weakref.ref(model)

    def function(state, iterator):
        model = model_ref()
        groups = _state_variables(model, kind)
        if len(state) != len(groups):
            raise ValueError(
                f"keras_memfit's {kind}_function expects Keras's JAX {kind} state of "
                f"{len(groups)} variable lists; received {len(state)}"
            )
        for group, new in zip(groups, state):
            if new is not None:
                assign(group, new)
        result = run_batches(next_batches(iterator, model.steps_per_execution))
        state = tuple(values(group) for group in groups)
        _publish(model, kind, state)
        return result, state

    return function


def is_end_of_data(exc: BaseException) -> bool:
    """Whether `exc` is how an epoch's iterator says it has no batch left."""
    return isinstance(exc, StopIteration)
