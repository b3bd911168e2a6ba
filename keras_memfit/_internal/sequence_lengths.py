"""The length given to an input dimension a model leaves unknown (a text model's tokens).

For a symbolic trace: the one asked for (`given`), else the model's (or its backbone's)
`max_sequence_length`, else unknown (the trace counts it as one).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator, Optional, Sequence, Tuple

_GIVEN: "contextvars.ContextVar[Optional[int]]" = contextvars.ContextVar(
    "keras_memfit_sequence_length", default=None
)


@contextlib.contextmanager
def given(length: Optional[int]) -> Iterator[None]:
    """Within the block, unknown input dimensions are `length` (None: the model's own)."""
    token = _GIVEN.set(length)
    try:
        yield
    finally:
        _GIVEN.reset(token)


def sequence_length(model: Any) -> Optional[int]:
    """The length for `model`'s unknown input dimensions, or None to leave them unknown."""
    explicit = _GIVEN.get()
    if explicit is not None:
        return explicit
    for source in (model, getattr(model, "backbone", None)):
        length = getattr(source, "max_sequence_length", None)
        if isinstance(length, int) and not isinstance(length, bool) and length > 0:
            return length
    return None


def filled(model: Any, shape: Sequence[Optional[int]]) -> Tuple[Optional[int], ...]:
    """`shape` with its unknown dimensions after the batch's set to `sequence_length`."""
    shape = tuple(shape)
    if not shape or all(d is not None for d in shape[1:]):
        return shape
    length = sequence_length(model)
    if length is None:
        return shape
    return shape[:1] + tuple(length if d is None else d for d in shape[1:])
