"""Symbolic traces of a model (`memory_report`): not implemented for JAX yet."""

from __future__ import annotations

from typing import Any

from keras_memfit.backend.base import Trace


def trace_layer_calls(model: Any) -> Trace:
    """Not implemented on JAX yet: raises `NotImplementedError`.

    The TensorFlow backend records every layer call of one `tf.function`
    trace; the JAX version (a `jax.make_jaxpr` trace with the batch
    dimension made symbolic) is still to be written.
    """
    raise NotImplementedError(
        "keras_memfit.memory_report (the model analysis) is not implemented for the "
        f"JAX backend yet; received model {getattr(model, 'name', model)!r}. Run it "
        "with KERAS_BACKEND=tensorflow: the report does not depend on the weights' values."
    )
