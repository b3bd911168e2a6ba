"""Where keras_memfit's JAX steps find the model's state: Keras's state tuple, or the variables.

Inside `threaded(model, kind, state)` the steps use Keras's state tuple (`get`, `put`); outside,
the variables, whose lists are taken once per call (`refresh`). `materialize(model)` moves the
tuple into the variables, for work that reads them, until the call ends.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, ContextManager, Dict, List, Optional, Sequence, Tuple

from keras.src.backend.common.stateless_scope import in_stateless_scope

from keras_memfit.backend.base import check_step_kind

GROUPS: Dict[str, Tuple[str, ...]] = {
    "train": ("trainable", "non_trainable", "optimizer", "metrics"),
    "test": ("trainable", "non_trainable", "metrics"),
    "predict": ("trainable", "non_trainable"),
}
"""The groups of Keras's JAX state tuple per kind of step function, in its order."""

_local = threading.local()
_lists: "weakref.WeakKeyDictionary[Any, Dict[str, List[Any]]]" = weakref.WeakKeyDictionary()


def variables(model: Any, group: str) -> List[Any]:
    if group == "optimizer":
        return list(model.optimizer.variables) if model.optimizer is not None else []
    if group not in GROUPS["train"]:
        raise ValueError(f"unknown state group {group!r}; expected one of {GROUPS['train']}")
    return list(getattr(model, f"{group}_variables"))  # trainable, non_trainable, metrics


def read(variables_: Sequence[Any]) -> List[Any]:
    """The current values of Keras variables, without Keras's checks (also where detached)."""
    if in_stateless_scope():
        return [v.value for v in variables_]
    return [v.value if v._value is None else v._value for v in variables_]


def write(variables_: Sequence[Any], values: Sequence[Any]) -> None:
    """Write a step's values into variables, skipping one already the variable's."""
    for v, value in zip(variables_, values):
        if v._value is not value:
            v._direct_assign(value)


class Threaded:
    """Keras's state tuple during one call of keras_memfit's step function (entered every step,
    so a class, not a generator context manager); `materialized`: the variables hold it."""

    def __init__(self, model: Any, kind: str, state: Sequence[Any]) -> None:
        self._model_ref = weakref.ref(model)
        self.names = GROUPS[kind]
        # Keras's own lists, not copies: lists are replaced here, never changed in place.
        self._values: Dict[str, List[Any]] = dict(zip(self.names, state))
        self.materialized = False
        self._detached = False
        self._variables: Dict[str, List[Any]] = {}
        self._outer: Optional[Threaded] = None  # the call in progress before this block

    def __enter__(self) -> "Threaded":
        self._outer = getattr(_local, "call", None)
        _local.call = self
        return self

    def __exit__(self, *exc_info: Any) -> None:
        _local.call = self._outer

    @property
    def model(self) -> Any:
        return self._model_ref()

    def taken_variables(self, name: str) -> Optional[List[Any]]:
        """The variable list of group `name` this call materialized into, if any."""
        return self._variables.get(name)

    def holds(self, names: Sequence[str]) -> bool:
        """Whether the tuple (not the variables) holds every group in `names`."""
        return not self.materialized and (
            names is self.names or all(n in self._values for n in names))

    def get(self, names: Sequence[str]) -> List[List[Any]]:
        # New lists, shared with nothing: each array's reference count tells who holds it.
        return [list(self._values[n]) for n in names]  # one comprehension: once per step

    def put(self, names: Sequence[str], values: Sequence[Sequence[Any]]) -> None:
        for name, group in zip(names, values):
            self._values[name] = list(group)

    def materialize(self) -> None:
        """Write the tuple into the model's variables; they hold the state from now on."""
        if self.materialized:
            return
        model = self.model
        self._variables = {name: variables(model, name) for name in self.names}
        self._detached = any(
            v._value is None for group in self._variables.values() for v in group
        )
        for name in self.names:
            write(self._variables[name], self._values[name])
        self.materialized = True

    def snapshot(self) -> Dict[str, List[Any]]:
        """The whole state now (references: JAX arrays are immutable)."""
        if self.materialized:
            return {name: read(self._variables[name]) for name in self.names}
        return dict(self._values)

    def restore(self, saved: Dict[str, List[Any]]) -> None:
        """Put back a `snapshot()`."""
        if self.materialized:
            for name in self.names:
                write(self._variables[name], saved[name])
        else:
            self._values = dict(saved)

    def state(self) -> Tuple[List[Any], ...]:
        """The state tuple to hand back to Keras."""
        return tuple(map(self.snapshot().__getitem__, self.names))

    def finish(self) -> Tuple[List[Any], ...]:
        """`state()`, then the variables detached again where Keras had detached them."""
        state = self.state()
        if self.materialized and self._detached:
            for group in self._variables.values():
                for v in group:
                    v._value = None
        return state


def threaded(model: Any, kind: str, state: Sequence[Any]) -> ContextManager[Threaded]:
    """Run keras_memfit's steps on Keras's state tuple for the block."""
    check_step_kind(kind)
    return Threaded(model, kind, state)


def active() -> Optional[Threaded]:
    """The threaded call in progress on this thread, unless materialized."""
    call = getattr(_local, "call", None)
    return call if call is not None and not call.materialized else None


def _call_on(model: Any) -> Optional[Threaded]:
    """The call in progress on this thread, if it is on `model`."""
    call = getattr(_local, "call", None)
    return call if call is not None and call.model is model else None


def _current(model: Any, names: Sequence[str]) -> Optional[Threaded]:
    call = _call_on(model)
    if call is None:
        return None
    if not call.holds(names):
        call.materialize()  # e.g. metrics asked for during a predict call
        return None
    return call


def refresh(model: Any) -> None:
    """Take the model's variable lists anew (once per keras_memfit call on the model)."""
    _lists.pop(model, None)


def _variables_of(model: Any, name: str) -> List[Any]:
    call = _call_on(model)
    taken = call.taken_variables(name) if call is not None else None
    if taken is not None:
        return taken  # materialized: the lists it took
    lists = _lists.setdefault(model, {})
    found = lists.get(name)
    if found is None:
        found = lists[name] = variables(model, name)
    return found


def get(model: Any, names: Sequence[str]) -> List[List[Any]]:
    """The current values of the groups `names` of `model`'s state."""
    call = _current(model, names)
    if call is not None:
        return call.get(names)
    return [read(_variables_of(model, name)) for name in names]


def put(model: Any, names: Sequence[str], values: Sequence[Sequence[Any]]) -> None:
    """Make `values` the new values of the groups `names` of `model`'s state."""
    call = _current(model, names)
    if call is not None:
        call.put(names, values)
        return
    for name, group in zip(names, values):
        write(_variables_of(model, name), group)


def materialize(model: Any) -> None:
    """Inside a threaded call on `model`, move the state into the variables (else nothing)."""
    call = _call_on(model)
    if call is not None:
        call.materialize()
