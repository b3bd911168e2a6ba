"""Every use of Keras's private API, in one place, with the range it was tested on.

keras_memfit reaches into Keras where no public API exists (its training
loop, its loss tracker, its symbolic build). Each such access is a function
here, so that a Keras release that moves something breaks one module, and
`TESTED_KERAS` says which releases CI checks.
"""

from __future__ import annotations

from typing import Any, Iterable

import keras

# MemFit reaches into Keras's training loop; CI tests both ends of this range.
TESTED_KERAS = ((3, 12), (3, 15))


def keras_version() -> tuple:
    """Keras's (major, minor), or () when the version string is unusual."""
    try:
        return tuple(int(p) for p in keras.__version__.split(".")[:2])
    except ValueError:
        return ()


def all_layers(model: keras.Model) -> Iterable[Any]:
    """The model and every layer nested in it (`Layer._flatten_layers`)."""
    return model._flatten_layers(include_self=True, recursive=True)
