"""PLACEHOLDER for the lead's `steps` module (compiled predict and test steps).

The training helper's branch needs `_compile` and `_needs_static_batch` from
`keras_memfit.backend.tensorflow.steps`, which the lead is writing at the
same time; these are verbatim copies of the two functions of the "Compiled
steps" section of `__init__`. At merge, take the lead's `steps.py` whole.
"""

from __future__ import annotations

from typing import Callable

import keras
import tensorflow as tf


def _compile(model: keras.Model, fn: Callable, static_shapes: bool = False) -> Callable:
    """`fn` compiled as Keras would compile the model's own steps.

    The step functions below reach the model through a weak reference, so
    that caching a compiled step per model (`keras_memfit._cache`) does not
    keep the model alive. `static_shapes` traces once per piece size instead
    of relaxing the batch dimension to unknown (see `_needs_static_batch`).
    """
    if getattr(model, "run_eagerly", False):
        return fn
    return tf.function(
        fn, reduce_retracing=not static_shapes, jit_compile=bool(model.jit_compile)
    )


def _needs_static_batch(model: keras.Model) -> bool:
    """Whether a step that splits batches must be traced with a static batch size.

    Keras weights each per-output loss tracker (multi-output models) by the
    *static* batch size of the outputs; in a step traced with an unknown batch
    dimension every piece would count as one sample, so pieces of different
    sizes would skew the per-output losses.
    """
    compile_loss = getattr(model, "_compile_loss", None)
    return bool(getattr(compile_loss, "metrics", None))
