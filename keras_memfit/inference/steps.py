"""The compiled predict and test steps of a model, built by the backend and cached per model."""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import keras

from keras_memfit import backend as _backend
from keras_memfit._internal import batches as _batches
from keras_memfit._internal import cache as _cache
from keras_memfit._internal import model_state as _model_state


def predict_step(model: keras.Model, postprocess: Optional[Callable] = None) -> Callable:
    """The compiled predict step (then `postprocess`), cached per model and replica devices."""
    key = (
        "predict", postprocess, bool(getattr(model, "run_eagerly", False)), model.jit_compile,
        _backend.get().step_variant(model),
    )
    return _cache.per_model(
        model, key, lambda: _backend.get().make_predict_step(model, postprocess)
    )


def test_step_and_guard(model: keras.Model, batch: Any, exact: bool = True) -> Tuple[Any, Any]:
    """The compiled test step and a metric-state guard, cached (`exact`: losses by rows)."""
    backend = _backend.get()
    whole = _model_state.stateful_layers(model) or not _batches.splittable(batch)
    sample = batch if whole else _batches.rows(batch, 0, 1)
    backend.prepare_test(model, sample)
    key = (
        "evaluate",
        exact,
        tuple(id(v) for v in model.metrics_variables),  # a recompile makes new ones
        bool(getattr(model, "run_eagerly", False)),
        model.jit_compile,
        backend.step_variant(model),
    )
    return _cache.per_model(
        model, key,
        lambda: (
            backend.make_test_step(model, exact=exact),
            backend.guard_variables(model.metrics_variables),
        ),
    )
