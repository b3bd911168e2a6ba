"""What a compiled TensorFlow step holds while it runs under XLA."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, List, Sequence, Tuple

import keras
import tensorflow as tf


def held_values(variables: Sequence[Any]) -> List[Any]:
    """The current values of `variables`, held so that an XLA call updating them donates nothing."""
    values = []
    for v in variables:
        inner = v if isinstance(v, tf.Variable) else getattr(v, "value", None)
        if isinstance(inner, tf.Variable):
            values.append(inner.read_value())
    return values


def _signature(data: Any) -> Tuple[Any, ...]:
    return tuple(
        (tuple(item.shape), str(getattr(item, "dtype", "")))
        if getattr(item, "shape", None) is not None else repr(item)
        for item in keras.tree.flatten(data)
    )


class XlaHolds:
    """What a compiled step that updates variables holds on each call under XLA.

    `small()` on every call; `large()` only on the first call at each input signature (later
    calls allocate the same buffers, so they fit). `active`: whether the steps run under XLA.
    """

    def __init__(
        self, model: keras.Model, small: Callable[[], Sequence[Any]],
        large: Callable[[], Sequence[Any]],
    ) -> None:
        self.active = bool(model.jit_compile) and not getattr(model, "run_eagerly", False)
        self._small, self._large = small, large
        self._ran: set = set()

    @contextlib.contextmanager
    def holding(self, data: Any) -> Iterator[None]:
        """Hold the values a call on `data` must keep while the block runs; note its success."""
        if not self.active:
            yield
            return
        signature = _signature(data)
        variables = list(self._small())
        if signature not in self._ran:
            variables += list(self._large())
        held = held_values(variables)
        try:
            yield
        finally:
            held.clear()  # the values go before the state is read or restored
        self._ran.add(signature)
