"""Counting XLA compilations, for the tests of how many shapes a call compiles.

`JaxCompiles` counts JAX's backend compilations (the
`/jax/core/compile/backend_compile_duration` event JAX records once per
executable it compiles; a cached shape records nothing). `TfCompiles` counts
the clusters TensorFlow's XLA compiles (`jit_compile=True` functions), from
the modules XLA dumps into a folder (`XLA_FLAGS=--xla_dump_to`, which must be
set before TensorFlow starts: `tf_dump_env(folder)`).

Example:
    >>> with JaxCompiles() as compiles:
    ...     model.predict(x, batch_size=1000, verbose=0)
    >>> compiles.count
    2
"""

from __future__ import annotations

import os
from typing import Dict, Optional

JAX_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class JaxCompiles:
    """Counts JAX's backend compilations while it is entered (a context manager).

    Attributes:
        count: Compilations so far (kept after the block ends).
    """

    def __init__(self) -> None:
        self.count = 0
        self._active = False

    def _listen(self, event: str, duration: float, **kwargs) -> None:
        if self._active and event == JAX_BACKEND_COMPILE_EVENT:
            self.count += 1

    def __enter__(self) -> "JaxCompiles":
        import jax

        self._active = True
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc) -> None:
        from jax._src import monitoring

        self._active = False
        monitoring.unregister_event_duration_listener(self._listen)


def tf_dump_env(folder: str) -> Dict[str, str]:
    """Environment for a child process whose XLA dumps every module it compiles into `folder`."""
    return {"XLA_FLAGS": f"--xla_dump_to={folder} --xla_dump_hlo_as_text"}


class TfCompiles:
    """Counts the XLA modules compiled while it is entered, from `folder`'s dumps.

    Every compilation dumps its module's optimised HLO once, under a name
    holding the module's unique id; the count is the number of new
    `*after_optimizations.txt` files (the dumps of the cluster's compilation,
    not of the buffer assignment).

    Args:
        folder: The dump folder given to `tf_dump_env` (None: $XLA_FLAGS's).
    """

    def __init__(self, folder: Optional[str] = None) -> None:
        if folder is None:
            flags = os.environ.get("XLA_FLAGS", "")
            parts = [p for p in flags.split() if p.startswith("--xla_dump_to=")]
            if not parts:
                raise ValueError(
                    "TfCompiles needs the XLA dump folder; received none and XLA_FLAGS="
                    f"{flags!r}: start the process with tf_dump_env(folder)"
                )
            folder = parts[0].split("=", 1)[1]
        self.folder = folder
        self.count = 0
        self._before: set = set()

    def _dumps(self) -> set:
        if not os.path.isdir(self.folder):
            return set()
        return {n for n in os.listdir(self.folder) if n.endswith("after_optimizations.txt")}

    def __enter__(self) -> "TfCompiles":
        self._before = self._dumps()
        return self

    def __exit__(self, *exc) -> None:
        self.count += len(self._dumps() - self._before)
