"""Plain Keras's `fit` without the memory cap, in a child process: what MemFit is compared with."""

from __future__ import annotations

import os
import shutil
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Dict, List

import numpy as np

from keras_memfit.app import env as _env
from keras_memfit.app import worker


def start_fit(
    model: Any, x: Any, y: Any, *, seed: int, **fit_kwargs: Any
) -> "Future[List[np.ndarray]]":
    """Start `model.fit(x, y, **fit_kwargs)` uncapped on a copy of `model`: a future of its weights.

    Call it before `model` trains, and `keras.utils.set_random_seed(seed)` right before your own
    `fit`, as the child does, so both shuffle alike. `fit_kwargs` must be JSON-serialisable.
    """
    folder = tempfile.mkdtemp(prefix="keras_memfit_reference_")
    model.save(os.path.join(folder, "model.keras"))
    np.savez(os.path.join(folder, "data.npz"), x=np.asarray(x), y=np.asarray(y))
    config = dict(folder=folder, seed=int(seed), fit_kwargs=fit_kwargs)
    environment = _env.worker_environment("cpu", None)  # no limit: the device changes nothing
    for key in _env.CAP_VARIABLES:
        environment.pop(key, None)

    def run() -> List[np.ndarray]:
        try:
            worker.run_worker(
                "keras_memfit.app.reference:_fit_work", config, report=lambda line: None,
                what="the reference fit's process", env=environment,
            )
            with np.load(os.path.join(folder, "weights.npz")) as weights:
                return [weights[f"w{i}"] for i in range(len(weights.files))]
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    pool = ThreadPoolExecutor(1)
    future = pool.submit(run)
    pool.shutdown(wait=False)
    return future


def max_difference(weights: List[np.ndarray], reference: List[np.ndarray]) -> float:
    """The largest absolute difference between two lists of weights, over every element."""
    return max(float(np.max(np.abs(a - b))) for a, b in zip(weights, reference))


def relative_difference(
    weights: List[np.ndarray], reference: List[np.ndarray], initial: List[np.ndarray]
) -> float:
    """`|weights - reference| / |reference - initial|`, all weights as one vector."""
    def norm(a: List[np.ndarray], b: List[np.ndarray]) -> float:
        return float(np.sqrt(sum(np.sum((x - y).astype("float64") ** 2) for x, y in zip(a, b))))

    return norm(weights, reference) / norm(reference, initial)


def _fit_work(config: Dict[str, Any], say: worker.Reporter) -> Dict[str, Any]:
    """The child: load, seed, fit, write the weights."""
    import keras

    folder = config["folder"]
    model = keras.models.load_model(os.path.join(folder, "model.keras"))
    with np.load(os.path.join(folder, "data.npz")) as data:
        x, y = data["x"], data["y"]
    keras.utils.set_random_seed(config["seed"])
    model.fit(x, y, verbose=0, **config["fit_kwargs"])
    weights = model.get_weights()
    np.savez(os.path.join(folder, "weights.npz"), **{f"w{i}": w for i, w in enumerate(weights)})
    return {}
