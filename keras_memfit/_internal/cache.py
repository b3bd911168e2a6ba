"""Compiled steps and guards cached per model, held weakly so that a deleted model is freed."""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Hashable

_PER_MODEL: "weakref.WeakKeyDictionary[Any, Dict[Hashable, Any]]" = weakref.WeakKeyDictionary()
_LIMIT = 8  # entries per model; the oldest goes first


def per_model(model: Any, key: Hashable, build: Callable[[], Any]) -> Any:
    """The value cached for `(model, key)`, built with `build()` on a miss."""
    entries = _PER_MODEL.setdefault(model, {})
    if key not in entries:
        if len(entries) >= _LIMIT:
            entries.pop(next(iter(entries)))
        entries[key] = build()
    return entries[key]


def forget(model: Any) -> None:
    """Forget every entry cached for `model` (its devices or functions changed)."""
    _PER_MODEL.pop(model, None)


def clear() -> None:
    """Forget every cached entry (tests use this between cases)."""
    _PER_MODEL.clear()
