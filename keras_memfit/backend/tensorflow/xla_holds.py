"""What a compiled TensorFlow step holds while it runs under XLA."""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

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

    def hold(self, data: Any) -> Tuple[Optional[Tuple[Any, ...]], List[Any]]:
        """The signature of a call on `data` and the values to hold while it runs."""
        if not self.active:
            return None, []
        signature = _signature(data)
        variables = list(self._small())
        if signature not in self._ran:
            variables += list(self._large())
        return signature, held_values(variables)

    def ran(self, signature: Optional[Tuple[Any, ...]]) -> None:
        """Record that a call at `signature` succeeded."""
        if signature is not None:
            self._ran.add(signature)
