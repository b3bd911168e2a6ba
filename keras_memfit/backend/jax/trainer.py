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
`run_batches(list_of_batches)`: it pulls up to `steps_per_execution`
batches and runs them with keras_memfit's steps working on `state` itself,
as Keras's own steps do (`state.threaded`: the variables are not touched on
the way), and returns the result with the new state. The steps donate
nothing of the state they start from, so whatever they raise, the state
Keras holds is whole. A train step MemFit started and left unsettled
(`keras_memfit._deferred`) is settled before Keras can write the state into
the variables: the hook makes `jax_state_sync` settle it first.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Callable, Iterator, List, Optional

import keras

from keras_memfit import _batches
from keras_memfit.backend.base import Settles
from keras_memfit.backend.jax import state as _state

_KINDS = ("train", "test", "predict")


def next_batches(iterator: Iterator[Any], count: int) -> List[Any]:
    """Up to `count` batches from a Keras epoch iterator (see `_batches.next_batches`)."""
    return _batches.next_batches(iterator, count, is_end_of_data)


_STATE_KEYS = {
    "train": ("trainable_variables", "non_trainable_variables", "optimizer_variables",
              "metrics_variables"),
    "test": ("trainable_variables", "non_trainable_variables", "metrics_variables"),
    "predict": ("trainable_variables", "non_trainable_variables"),
}


def _publish(model: keras.Model, kind: str, state: tuple) -> None:
    """Make `state` the one Keras's `jax_state_sync` writes back.

    Keras sets the trainer's `_jax_state` only after the step function
    returned; a callback that reads `Callback.model` in between makes Keras
    write the *previous* step's state into the variables, and when the step
    function raises, Keras's closing sync writes the state it last had.
    Setting it here first (also when `run_batches` raised: the pieces that
    succeeded are kept, as on TensorFlow) keeps every sync current. Set
    without Keras's attribute tracking, which would wrap the lists (Keras
    itself then sets it with tracking after the step function returned).
    Set also when the trainer has none yet (the first step of a call failed):
    else Keras's closing sync would leave the variables it detached empty.
    """
    object.__setattr__(model, "_jax_state", dict(zip(_STATE_KEYS[kind], state)))


def step_function(
    model: keras.Model,
    kind: str,
    run_batches: Callable[[List[Any]], Any],
    deferred: Optional[Settles] = None,
) -> Callable[[Any, Any], Any]:
    """A replacement for `model.<kind>_function` that runs `run_batches`.

    Args:
        model: The model whose function is replaced.
        kind: "train", "test" or "predict".
        run_batches: Runs a list of Keras batches; returns what Keras expects
            of the function (the logs; for "predict", the batches' outputs).
        deferred: What holds the train steps `run_batches` may leave
            unsettled (MemFit's run; see `keras_memfit._deferred`), which
            settles them itself when it runs the next batches. The hook
            settles them when the iterator has no batch left, and, while one
            is unsettled after a call, before Keras writes the state into the
            model's variables (`jax_state_sync`: at the end of an epoch, or
            when a callback reads `Callback.model`).

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
    groups = _state.GROUPS[kind]
    # Made once, set as the model's `jax_state_sync` after each call that left
    # a step unsettled (see `_SettleBeforeSync`).
    sync_hook = None if deferred is None else _SettleBeforeSync(model, deferred)

    def function(state, iterator):
        model = model_ref()
        if len(state) != len(groups):
            raise ValueError(
                f"keras_memfit's {kind}_function expects Keras's JAX {kind} state of "
                f"{len(groups)} variable lists; received {len(state)}"
            )
        if sync_hook is not None:
            model.__dict__.pop("jax_state_sync", None)  # settled here instead
        try:
            with _state.threaded(model, kind, state) as call:
                try:
                    try:
                        batches = next_batches(iterator, model.steps_per_execution)
                    except BaseException:
                        if deferred is not None:
                            deferred.settle()  # the end of the epoch's data
                        raise
                    result = run_batches(batches)
                finally:
                    state = call.finish()
                    _publish(model, kind, state)
        finally:
            if sync_hook is not None and deferred.pending:
                sync_hook.install(model)
        return result, state

    return function


class _SettleBeforeSync:
    """Until the next call, Keras's `jax_state_sync` settles `deferred` first.

    Keras writes its state tuple into the model's variables with
    `jax_state_sync` (at the end of an epoch, in `fit`'s closing `finally`,
    and when a callback reads `Callback.model`); the step left unsettled
    must be settled (and its batch run again if it failed) before that.
    `install` sets this as an attribute of the model that shadows the
    method; it is removed at its first use on the loop's thread or at the
    next call of the step function.
    """

    def __init__(self, model: keras.Model, deferred: Settles) -> None:
        self._model_ref = weakref.ref(model)
        self._deferred = deferred
        self._loop_thread: Optional[int] = None

    def install(self, model: keras.Model) -> None:
        """Shadow `model.jax_state_sync` (called on the loop's thread)."""
        self._loop_thread = threading.get_ident()
        object.__setattr__(model, "jax_state_sync", self)

    def __call__(self) -> Any:
        model = self._model_ref()
        if threading.get_ident() == self._loop_thread:
            model.__dict__.pop("jax_state_sync", None)
        # In `settling(model)`; on a callback's thread, waits for the loop's.
        self._deferred.settle()
        return type(model).jax_state_sync(model)


@contextlib.contextmanager
def settling(model: keras.Model) -> Iterator[None]:
    """Where MemFit settles its started train steps outside its step function.

    Inside MemFit's train function the steps work on the state tuple Keras
    passed it. Elsewhere during `fit` (a callback reading a batch's logs,
    Keras's `jax_state_sync`), the state Keras holds is its `_jax_state`,
    and its variables are detached: this runs the block on that state, and
    if the block changed it (a started step that failed was undone and its
    batch run again), gives it to Keras as a callback reading
    `Callback.model` would: written into the variables, from which Keras's
    loop then takes it for the next step.
    """
    keras_state = getattr(model, "_jax_state", None)
    call = _state.active()
    if (call is not None and call.model is model) or not keras_state:
        yield
        return
    kind = "train"
    state = tuple(keras_state.get(key) for key in _STATE_KEYS[kind])
    if any(group is None for group in state):
        yield
        return
    with _state.threaded(model, kind, state) as call:
        try:
            yield
        finally:
            new_state = call.finish()
            changed = any(
                a is not b for old, new in zip(state, new_state) for a, b in zip(old, new)
            )
            if changed:
                _publish(model, kind, new_state)
                type(model).jax_state_sync(model)


def call_keras_function(
    model: keras.Model, kind: str, function: Callable[..., Any], batches: List[Any]
) -> Any:
    """Refused on JAX: batches MemFit cannot split (sparse BCOO) are not run.

    Keras's JAX `<kind>_function` takes and donates the state tuple that
    MemFit's step function threads (and its guards hold), so handing it over
    would delete arrays keras_memfit still uses, and an OOM in it would lose
    the model. Not done yet: such batches raise a clear error instead.

    Raises:
        NotImplementedError: Always, naming what MemFit received.
    """
    described = _batches.unsplittable(_batches.as_chunk(batches[0])) or "a batch"
    raise NotImplementedError(
        f"MemFit on JAX cannot run batches it cannot split into pieces; received "
        f"{described} in {kind}. Densify those inputs (or pass them as numpy "
        "arrays), or call without MemFit."
    )


def is_end_of_data(exc: BaseException) -> bool:
    """Whether `exc` is how an epoch's iterator says it has no batch left."""
    return isinstance(exc, StopIteration)
