"""The backend seam: everything that depends on Keras's backend lives behind it.

keras_memfit's core (planning batch sizes, splitting and stitching batches,
retrying, MemFit's strategies, the model analysis) is backend-neutral. What
differs per backend lives in one package per backend,
`keras_memfit.backend.<name>`. The seam is split by concern into the
protocols of `keras_memfit.backend.base`, each documented there once and
provided by the module of that name in every backend package (`CONCERNS`:
`oom`, `memory`, `steps`, `training`, `trainer`, `devices`, `tracing`,
`distribution`); `base` also types the values that cross the seam (`Spec`,
`NO_SPEC`, `StepOutcome`, `TrainStep`, `Accumulator`, `Guard`). A backend
package keeps no list of what it exports: its `__init__` calls `assemble`,
which takes every protocol's members from their modules.

- `base`: the seam's contract, typed: one protocol per concern;
- `kinds`: what kind of tensor a value is, by class, importing no framework;
- `_layer_calls`: recording every layer and operation call of one symbolic
  forward pass (the backends' `tracing`);
- `_placement_refused`: `place`'s functions on a backend that cannot keep
  layers on another device;
- `tensorflow`: the TensorFlow backend;
- `jax`: the JAX backend;
- `torch`: the PyTorch backend.

`get()` returns the active backend's package; it is the only way the rest of
keras_memfit reaches a backend, and it imports nothing until it is called.
TensorFlow, JAX and PyTorch ("torch") are implemented; `get()` names the
backend in its error for the others. A new backend is a new package with
the concerns' modules, its `__init__` calling `assemble`, and its name in
`SUPPORTED` (`tests/test_backend_seam.py` checks that it provides every
member).
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Tuple

import keras

from keras_memfit.backend.base import CONCERNS, NO_SPEC, Spec, StartableStep, StepOutcome, members

if TYPE_CHECKING:
    from keras_memfit.backend.base import Backend

__all__ = [
    "NO_SPEC", "Spec", "StartableStep", "StepOutcome", "SUPPORTED", "assemble", "get", "name",
]

SUPPORTED: Tuple[str, ...] = ("tensorflow", "jax", "torch")


def name() -> str:
    """The name of Keras's active backend ("tensorflow", "jax", ...)."""
    return keras.backend.backend()


def get() -> "Backend":
    """The keras_memfit backend package for Keras's active backend.

    Returns:
        The package implementing the seam: every member of the protocols of
        `keras_memfit.backend.base` (see `assemble`).

    Raises:
        NotImplementedError: If the active Keras backend is not supported yet.
    """
    active = name()
    if active in SUPPORTED:
        return importlib.import_module(f"keras_memfit.backend.{active}")
    raise NotImplementedError(
        f"keras_memfit supports the Keras backends {list(SUPPORTED)}; the "
        f"active backend is {active!r}. Set KERAS_BACKEND=tensorflow, "
        "KERAS_BACKEND=jax or KERAS_BACKEND=torch before importing keras."
    )


def assemble(package: str) -> None:
    """Give the backend package `package` every concern's members, from its modules.

    For each `(module, protocol)` of `base.CONCERNS`, each name the protocol
    declares is read from `<package>.<module>` and set on the package: the
    protocols, not a list, say what a backend exports. Called once, by the
    backend package's own `__init__`.

    Raises:
        AttributeError: If a module lacks a member of its protocol.

    Example:
        >>> assemble(__name__)  # the last line of a backend package's __init__
    """
    namespace = vars(sys.modules[package])
    for concern, protocol in CONCERNS:
        module = importlib.import_module(f"{package}.{concern}")
        for member in members(protocol):
            namespace[member] = getattr(module, member)
