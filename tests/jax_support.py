"""Harness for the JAX backend's tests: each runs in a child process under JAX.

The test suite's own process runs Keras on TensorFlow (Keras picks its
backend once per process), so a JAX test is a function run in a fresh child
with `KERAS_BACKEND=jax` (and `JAX_PLATFORMS=cpu`), by
`run_in_jax(__file__, "function")`; the test fails with the child's
output when the function raises.

Real out-of-memory errors: JAX's CPU client has no capped allocator, but an
address-space limit set before jax starts (`address_space_gb=`, applied
with `resource.setrlimit(RLIMIT_AS, ...)` in the child) makes over-large
allocations fail with a genuine, recoverable `RESOURCE_EXHAUSTED`, at once.

Where jax is not installed (the TensorFlow CI leg), `requires_jax` skips
these tests with that reason; they never pass silently.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from typing import Dict, Optional

import pytest

from tests.child import run_child, run_function

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JAX_AVAILABLE = importlib.util.find_spec("jax") is not None
requires_jax = pytest.mark.skipif(
    not JAX_AVAILABLE,
    reason=f"jax is not installed for {sys.executable} (the TensorFlow CI leg); the JAX "
    "leg runs these tests (pip install 'jax[cpu]')",
)


def run_in_jax(
    path: str,
    function: str,
    *,
    address_space_gb: Optional[float] = None,
    devices: int = 1,
    env: Optional[Dict[str, str]] = None,
    timeout: float = 600,
) -> str:
    """Run `function` of the test module `path` in a child Python with Keras on JAX.

    Args:
        path: The test module's file (`__file__`).
        function: Name of a function of that module taking no arguments.
        address_space_gb: Address-space limit for the child (real OOMs), or None.
        devices: Host devices JAX makes (`--xla_force_host_platform_device_count`).
        env: Extra environment variables for the child.
        timeout: Seconds before the child is killed.

    Returns:
        The child's stdout and stderr.

    Example:
        >>> run_in_jax(__file__, "child_predict", address_space_gb=5)
    """
    target = f"{os.path.abspath(path)}:{function}"
    child_env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
    child_env.pop("XLA_FLAGS", None)
    if devices > 1:
        child_env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    # (Tests whose limit is tight pass MALLOC_ARENA_MAX=1 in `env`: each thread's
    # malloc arena reserves 64 MiB of address space it does not use, a varying
    # number of them, which the limit counts. It is not the default: the real-OOM
    # tests' limits are sized with the arenas, and with one arena their calls
    # would meet no OOM.)
    child_env.update(env or {})
    limit = str(int(address_space_gb * (1 << 30))) if address_space_gb else "0"
    proc = run_child(["-m", "tests.jax_support", target, limit], child_env, timeout)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        pytest.fail(f"{target} failed under JAX (exit {proc.returncode}):\n{output[-6000:]}")
    return output


# The real-OOM scenario under an address-space limit: the full batch of
# REAL_OOM_ROWS rows needs about 4.3 GB of activations (JAX's own address space
# is about 1.5 GB of the REAL_OOM_LIMIT_GB); a sixteenth, REAL_OOM_FITS, fits.
REAL_OOM_LIMIT_GB = 5
REAL_OOM_ROWS = 65536
REAL_OOM_FITS = REAL_OOM_ROWS // 16


def _classifier(features, hidden, optimizer):
    """Dense(hidden, relu), Dense(3, softmax) on `features` inputs, compiled, seeded."""
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((features,)),
        keras.layers.Dense(hidden, activation="relu"),
        keras.layers.Dense(3, activation="softmax"),
    ])
    model.compile(optimizer, "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def hide_address_space_limit():
    """Make keras_memfit see no memory limit on JAX's CPU, as on a platform without
    memory statistics: under the address-space limit it would size pieces from
    that limit and pay no OOM, and the tests calling this check the recovery
    from real OOMs (the known-limit path: tests/test_jax_compiles.py)."""
    from keras_memfit.backend.jax import memory

    memory._address_space = lambda: None


def real_oom_model():
    """Dense(16384, relu), Dense(3, softmax) on 8 features, compiled (sgd), seeded."""
    return _classifier(8, 16384, "sgd")


def real_oom_batches(sizes, with_targets=True):
    """A `keras.utils.PyDataset` of batches of `sizes` rows for `real_oom_model`
    (8 uniform features, 3 classes, seeded); returns it and all its `x` and `y`."""
    import keras
    import numpy as np

    rng = np.random.default_rng(0)
    rows = sum(sizes)
    x, y = rng.random((rows, 8), dtype=np.float32), rng.integers(0, 3, rows)
    bounds = np.cumsum([0] + list(sizes))

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return len(sizes)

        def __getitem__(self, i):
            part = slice(bounds[i], bounds[i + 1])
            return (x[part], y[part]) if with_targets else x[part]

    return Batches(), x, y


def small_model():
    """Dense(32, relu), Dense(3, softmax) on 12 features, compiled (adam, accuracy), seeded."""
    return _classifier(12, 32, "adam")


def small_data(n=160):
    """`n` rows of 12 normal features and 3 integer classes, for `small_model`."""
    import numpy as np

    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 12)).astype("float32"), rng.integers(0, 3, n).astype("int32")


def _child_main(target: str, limit: int) -> None:
    if limit:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))  # before jax starts
    run_function(target)


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    _child_main(sys.argv[1], int(sys.argv[2]))


class OOMCounter(logging.Handler):
    """Counts keras_memfit's WARNINGs that contain `phrase` (the planner's OOM lines).

    Example:
        >>> ooms = OOMCounter()
        >>> keras_memfit.safe_predict(model, x, verbose=0)
        >>> ooms.count  # "out of memory at batch_size=..." lines
    """

    def __init__(self, phrase: str = "out of memory") -> None:
        super().__init__(logging.WARNING)
        self.phrase = phrase
        self.count = 0
        logging.getLogger("keras_memfit").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.count += self.phrase in record.getMessage()
