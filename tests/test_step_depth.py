"""How deep a MemFit training step is: calls from Keras's `train_function` to the backend's step.

Keras's own trainer reaches its compiled step in about three calls; MemFit's in at most
six (issue #48): the function MemFit installs, `Run.train`, `Run._train_batch`,
`runner.run_whole`, `runner._attempt` and the backend's `TrainStep.__call__`. Every
Python frame between the installed function and the step counts, generators included.
"""

from __future__ import annotations

import os
import sys

import keras
import numpy as np

from keras_memfit import MemFit
from keras_memfit.backend.base import TrainStep

MAX_DEPTH = 6
BACKEND_DIR = os.path.join("keras_memfit", "backend") + os.sep
INSTALLED = os.path.join("keras_memfit", "callbacks.py")


def _depths_of_fit(model, x, y, batch_size):
    """The depth of every call of a backend `TrainStep` during `fit` with MemFit."""
    depths = []

    def profile(frame, event, arg):
        if event != "call" or frame.f_code.co_name != "__call__":
            return
        if BACKEND_DIR not in frame.f_code.co_filename:
            return
        if not isinstance(frame.f_locals.get("self"), TrainStep):
            return
        depth, caller = 1, frame.f_back
        while caller is not None:
            depth += 1
            if caller.f_code.co_name == "installed" and caller.f_code.co_filename.endswith(
                    INSTALLED):
                depths.append(depth)
                return
            caller = caller.f_back
        depths.append(None)  # not called from MemFit's function

    sys.setprofile(profile)
    try:
        model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0, shuffle=False,
                  callbacks=[MemFit()])
    finally:
        sys.setprofile(None)
    return depths


def test_a_memfit_train_step_is_at_most_six_calls_below_keras():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 8)).astype("float32")
    y = rng.normal(size=(32, 1)).astype("float32")

    depths = _depths_of_fit(model, x, y, batch_size=16)

    assert len(depths) == 2, depths  # one step per batch, each from MemFit's function
    assert all(depth is not None and depth <= MAX_DEPTH for depth in depths), depths


def test_the_depth_check_counts_every_frame(monkeypatch):
    """One more call between MemFit's function and the step is seen."""
    from keras_memfit.planning import runner

    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x = np.zeros((16, 8), "float32")
    y = np.zeros((16, 1), "float32")
    attempt = runner._attempt

    def deeper(*args, **kwargs):
        return attempt(*args, **kwargs)

    monkeypatch.setattr(runner, "_attempt", deeper)
    depths = _depths_of_fit(model, x, y, batch_size=16)
    assert depths == [MAX_DEPTH + 1]
