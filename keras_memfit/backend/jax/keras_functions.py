"""Keras's step functions in the JAX trainer's calling convention.

Keras calls `model.train_function(state, iterator)` and expects `(result, state)` back;
MemFit's function runs its steps on that state tuple (`state.threaded`), donating none of it.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, List, Optional, Tuple

import keras

from keras_memfit._internal import batches as _batches
from keras_memfit.backend.base import KerasCall
from keras_memfit.backend.jax import processes as _processes
from keras_memfit.backend.jax import state as _state


def _publish(model: keras.Model, kind: str, state: tuple) -> None:
    """Make `state` what Keras's `jax_state_sync` writes back before Keras sets it (after the
    function returned) and after a raise; untracked, so that Keras does not wrap the lists."""
    keys = [f"{group}_variables" for group in _state.GROUPS[kind]]
    object.__setattr__(model, "_jax_state", dict(zip(keys, state)))


class _StateCall(KerasCall):
    """`function(state, iterator) -> (result, state)`; batches are pulled one at a time."""

    def __init__(self, model: keras.Model, kind: str, state: tuple, iterator: Any) -> None:
        self._threaded = _state.threaded(model, kind, state)
        groups = self._threaded.names
        if len(state) != len(groups):
            raise ValueError(
                f"keras_memfit's {kind}_function expects Keras's JAX {kind} state of "
                f"{len(groups)} variable lists; received {len(state)}"
            )
        self._model, self._kind, self._iterator = model, kind, iterator
        self._several = _processes.multi_process()
        self.state: Optional[tuple] = None

    def __enter__(self) -> "_StateCall":
        self._threaded.__enter__()
        try:
            batches = _batches.pull_batches(
                self._iterator, self._model.steps_per_execution, is_end_of_data)
        except BaseException as exc:
            self.__exit__(type(exc), exc, exc.__traceback__)
            raise
        if self._several:  # each process runs its own rows (see `processes`)
            batches = (_processes.local_rows(batch) for batch in batches)
        self.batches = batches
        return self

    def __exit__(self, exc_type: Any, exc: Optional[BaseException], traceback: Any) -> None:
        try:
            if self._several and isinstance(exc, Exception) and not is_end_of_data(exc):
                _processes.post_failure(exc)  # the other processes stop at once
        finally:
            self.state = self._threaded.finish()
            _publish(self._model, self._kind, self.state)
            self._threaded.__exit__(exc_type, exc, traceback)

    def returned(self, result: Any) -> Tuple[Any, tuple]:
        return result, self.state


def keras_call(model: keras.Model, kind: str, *args: Any) -> _StateCall:
    """`args`: `(state, iterator)`."""
    state, iterator = args
    return _StateCall(model, kind, state, iterator)


def adapter_batches(adapter: Any) -> Iterator[Any]:
    """Keras's own JAX iterator (sparse matrices as JAX `BCOO` arrays)."""
    return iter(adapter.get_jax_iterator())


def call_keras_function(
    model: keras.Model, kind: str, function: Callable[..., Any], batches: List[Any]
) -> Any:
    """Keras's function on MemFit's state, its new state put back (it donates the state)."""
    names = _state.GROUPS[kind]
    state = tuple(_state.get(model, names))
    result, new_state = function(state, iter(batches))
    _state.put(model, names, new_state)
    return result


def is_end_of_data(exc: BaseException) -> bool:
    return isinstance(exc, StopIteration)


materialize = _state.materialize
