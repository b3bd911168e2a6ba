"""What a compiled TensorFlow step holds while it runs under XLA.

TensorFlow's XLA launch donates the buffers of the variables a compiled
function updates; an OOM of that call would leave them freed while the
variables still point at them. `held_values` keeps them alive, and
`XlaHolds` decides, per call, which ones: the small state always, the large
state only on the first call at each input signature.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import keras
import tensorflow as tf


def held_values(variables: Sequence[Any]) -> List[Any]:
    """The current values of `variables`, to hold while an XLA call that updates them runs.

    TensorFlow's XLA launch donates the buffer of a resource variable the
    compiled function updates when nothing else references it, and when the
    call then fails (an OOM while XLA allocates, before anything runs) the
    donated buffer is freed while the variable still holds it: the variable
    reads freed memory, and its next assignment frees the buffer again
    (`bfc_allocator.cc: Check failed: c->in_use()` aborts the process).
    Holding a reference to each value while the call runs keeps it from
    being donated: XLA writes the updates into new buffers (the updated
    variables' bytes more during the call), and a failed call leaves the
    variables as they were.
    """
    values = []
    for v in variables:
        inner = v if isinstance(v, tf.Variable) else getattr(v, "value", None)
        if isinstance(inner, tf.Variable):
            values.append(inner.read_value())
    return values


def _signature(data: Any) -> Tuple[Any, ...]:
    """What an XLA program is compiled for: the shapes and dtypes of `data`'s tensors."""
    return tuple(
        (tuple(item.shape), str(getattr(item, "dtype", "")))
        if getattr(item, "shape", None) is not None else repr(item)
        for item in keras.tree.flatten(data)
    )


class XlaHolds:
    """What a compiled step that updates variables holds on each call under XLA.

    See `held_values`: a held variable survives an OOM of the call, at the
    cost of its bytes more during the call. The small state (`small()`:
    metrics, counters, snapshots) is held on every call. The large state
    (`large()`: weights, optimizer slots, gradient sums) only on the first
    call at each input signature: an XLA program allocates the same buffers
    at every call, so once one succeeded its next calls fit as well (unless
    the free memory shrank meanwhile), and the steady state donates them as
    Keras's own step does. Without `jit_compile` nothing is held (TensorFlow
    updates in place, and an OOM frees nothing it should not).

    Attributes:
        active: Whether the model's steps run under XLA.
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
