"""Argument checks shared by the public functions (errors name the argument)."""

from __future__ import annotations

import numbers
from typing import Any, Optional


def positive_int(name: str, value: Any, allow_none: bool = True) -> Optional[int]:
    """Return `value` if it is a positive int (or None when allowed)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        allowed = "a positive int or None" if allow_none else "a positive int"
        raise ValueError(f"{name} must be {allowed}; received {name}={value!r}")
    return int(value)


def verbosity(value: Any) -> int:
    """Keras's verbose values: "auto", 0, 1 or 2; "auto" means 1."""
    if value == "auto":
        return 1
    if isinstance(value, bool) or value not in (0, 1, 2):
        raise ValueError(f'verbose must be "auto", 0, 1 or 2; received verbose={value!r}')
    return int(value)


def model(value: Any) -> None:
    """Check that `value` looks like a Keras model."""
    import keras

    if not isinstance(value, keras.Model):
        raise TypeError(
            f"model must be a keras.Model; received {type(value).__name__}: {value!r:.80}"
        )


def batch_size_for(x: Any, batch_size: Optional[int], advice: str = "") -> None:
    """Reject a `batch_size` for input that comes batched already.

    Args:
        x: The input.
        batch_size: The validated `batch_size` argument.
        advice: A sentence appended to the error (e.g. what to use instead).

    Raises:
        ValueError: If `batch_size` is given and `x` is a dataset, a
            PyDataset or a generator.
    """
    from keras_memfit.data import is_array_like

    if batch_size is not None and not is_array_like(x):
        raise ValueError(
            "batch_size must be None when x is a dataset, a PyDataset or a generator "
            f"(they are already batched); received batch_size={batch_size} with x of "
            f"type {type(x).__name__}" + (f". {advice}" if advice else "")
        )
