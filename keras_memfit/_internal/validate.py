"""Argument checks shared by the public functions (errors name the argument)."""

from __future__ import annotations

import numbers
from typing import Any, Optional

from keras_memfit._internal import legacy as _legacy


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
    """Check that `value` looks like a Keras model (and not a Keras 2 / tf_keras one)."""
    import keras

    _legacy.refuse(value)
    if not isinstance(value, keras.Model):
        raise TypeError(
            f"model must be a keras.Model; received {type(value).__name__}: {value!r:.80}"
        )


def unknown_kwargs(function: str, kwargs: dict) -> None:
    """Raise the ValueError `model.evaluate` raises for `kwargs` it does not take, if any."""
    if kwargs:
        raise ValueError(
            f"Arguments not recognized: {kwargs}. {function} takes the arguments of "
            "model.evaluate (x, y, batch_size, verbose, sample_weight, steps, "
            "callbacks, return_dict) and exact_output_losses."
        )
