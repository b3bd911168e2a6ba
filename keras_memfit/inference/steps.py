"""The compiled predict and test steps of a model, built by the backend and cached per model.

`safe_predict`, `safe_evaluate` and MemFit (for `predict` and the
validation inside `fit`) all run these, so a model traces each once.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import keras

from keras_memfit import backend as _backend
from keras_memfit._internal import cache as _cache
from keras_memfit._internal import model_state as _model_state
from keras_memfit.planning import data as _data


def predict_step(model: keras.Model, postprocess: Optional[Callable] = None) -> Callable:
    """The compiled predict step (then `postprocess`) for `model`, cached per model.

    One per set of replica devices: a model used inside a strategy's scope
    and outside it gets a step for each.
    """
    key = (
        "predict", postprocess, bool(getattr(model, "run_eagerly", False)), model.jit_compile,
        _backend.get().replica_devices(model),
    )
    return _cache.per_model(
        model, key, lambda: _backend.get().make_predict_step(model, postprocess)
    )


def test_step_and_guard(model: keras.Model, batch: Any, exact: bool = True) -> Tuple[Any, Any]:
    """The compiled test step for `model` and a guard over its metric state.

    Builds the model's metrics from `batch` (an `(x, y, sample_weight)`
    chunk) first: from its first row, or, for a model with stateful layers,
    from all of it (a Keras batch); both are cached per model, so repeated
    calls (and MemFit's validation) trace once. `exact` is the backend's
    `make_test_step`'s: per-output loss trackers weighted by rows (True), or
    as Keras's own `evaluate` weights them (False).
    """
    backend = _backend.get()
    whole = _model_state.stateful_layers(model) or not _data.splittable(batch)
    sample = batch if whole else _data.rows(batch, 0, 1)
    backend.prepare_test(model, sample)
    key = (
        "evaluate",
        exact,
        tuple(id(v) for v in model.metrics_variables),  # a recompile makes new ones
        bool(getattr(model, "run_eagerly", False)),
        model.jit_compile,
        backend.replica_devices(model),  # inside a strategy's scope, or not
    )
    return _cache.per_model(
        model, key,
        lambda: (
            backend.make_test_step(model, exact=exact),
            backend.guard_variables(model.metrics_variables),
        ),
    )
