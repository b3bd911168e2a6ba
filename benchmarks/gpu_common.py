"""What the scenarios of `benchmarks.gpu` share, in its children: the models, their data, outcomes.

Imported only in a child (`benchmarks.gpu_child`, `gpu_jax`, `gpu_torch`)
once its memory is limited; the frameworks are imported inside the
functions.
"""

from __future__ import annotations

import gc
import os
from typing import Any, Callable, Dict


def backend() -> str:
    return os.environ["KERAS_BACKEND"]


def surface(model) -> None:
    """Wait for the model's variables: on JAX an asynchronous failure surfaces here."""
    if backend() == "jax":
        import jax

        jax.block_until_ready([v.value for v in model.variables])
    else:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()


def forward_pass(net) -> Callable[[Any], None]:
    """`net`'s forward pass on numpy rows, waited for, holding no Keras state.

    On JAX a jitted `stateless_call` on the variables' values; on torch the
    model called under `torch.no_grad()` on the device.
    """
    if backend() == "jax":
        import jax

        run = jax.jit(lambda trainable, other, x: net.stateless_call(trainable, other, x)[0])

        def call(x):
            jax.block_until_ready(run([v.value for v in net.trainable_variables],
                                      [v.value for v in net.non_trainable_variables], x))

        return call
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"

    def call(x):
        with torch.no_grad():
            net(torch.as_tensor(x, device=device))
        if device == "cuda":
            torch.cuda.synchronize()

    return call


def free() -> None:
    """Drop what earlier calls left (Keras's global state, garbage, torch's cached blocks)."""
    import keras

    keras.backend.clear_session()
    gc.collect()
    if backend() == "torch":
        import torch

        torch.cuda.empty_cache()  # a no-op where CUDA never started


def outcome(call: Callable[[], Any]) -> str:
    """"fits", "OOM", or the exception's type name: what a plain Keras call did."""
    from keras_memfit import is_oom_error

    try:
        call()
    except Exception as err:  # noqa: BLE001 - the outcome being measured
        return "OOM" if is_oom_error(err) else type(err).__name__
    return "fits"


def error_form(err: BaseException) -> Dict[str, Any]:
    """An exception as the report shows it: its type, its first line, whether it is an OOM."""
    from keras_memfit import is_oom_error

    lines = str(err).strip().splitlines()
    return {"type": f"{type(err).__module__}.{type(err).__qualname__}",
            "line": " ".join(lines[0].split())[:160] if lines else "",
            "oom": bool(is_oom_error(err))}


# ------------------------------------------------------------------ models
def model(kind: str):
    """A compiled, seeded model: "cnn" (the seed's Kaggle CNN) or "dense" (a memory-heavy MLP).

    "dense", Dense(16384, relu) > Dense(10) on 8 features, is the CPU
    stand-in (as in tests/test_jax_real_oom.py): XLA's CPU convolutions
    hardly allocate, so the CNN meets no OOM there.
    """
    import keras

    keras.utils.set_random_seed(0)
    if kind == "cnn":
        from keras_memfit.app.demo import build_cnn

        return build_cnn()
    dense = keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(16384, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])
    dense.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    return dense


def data(kind: str, rows: int):
    """`rows` seeded inputs for `model(kind)` and labels 0..9."""
    import numpy as np

    rng = np.random.default_rng(0)
    shape = (rows, 28, 28, 1) if kind == "cnn" else (rows, 8)
    return rng.random(shape, dtype=np.float32), rng.integers(0, 10, rows)
