"""The backend seam: everything that depends on Keras's backend lives behind it.

`get()` returns the active backend's package (the rest of keras_memfit's one way to a backend).

- `base`: the seam's contract, typed: one protocol per concern;
- `_layer_calls`: recording every layer and operation call of one symbolic forward pass;
- `tensorflow`: the TensorFlow backend;
- `jax`: the JAX backend;
- `torch`: the PyTorch backend.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Tuple

import keras

from keras_memfit.backend.base import NO_SPEC, Spec, StartableStep, StepOutcome

if TYPE_CHECKING:
    from keras_memfit.backend.base import Backend

__all__ = ["NO_SPEC", "Spec", "StartableStep", "StepOutcome", "SUPPORTED", "get", "name"]

SUPPORTED: Tuple[str, ...] = ("tensorflow", "jax", "torch")


def name() -> str:
    """The name of Keras's active backend ("tensorflow", "jax", ...)."""
    return keras.backend.backend()


def get() -> "Backend":
    """The keras_memfit backend package for Keras's active backend.

    Raises:
        NotImplementedError: If the active Keras backend is not supported.
    """
    active = name()
    if active in SUPPORTED:
        return importlib.import_module(f"keras_memfit.backend.{active}")
    raise NotImplementedError(
        f"keras_memfit supports the Keras backends {list(SUPPORTED)}; the "
        f"active backend is {active!r}. Set KERAS_BACKEND=tensorflow, "
        "KERAS_BACKEND=jax or KERAS_BACKEND=torch before importing keras."
    )
