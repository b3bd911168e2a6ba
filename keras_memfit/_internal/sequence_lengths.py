"""The length a trace gives input dimensions a model leaves unknown (a text model's tokens)."""

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
    """`given`'s length, else the model's (or backbone's) `max_sequence_length`, else None."""
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
    length = sequence_length(model) if None in shape[1:] else None
    if length is None:
        return shape
    return shape[:1] + tuple(length if d is None else d for d in shape[1:])
