"""What kind of tensor a value is, across frameworks, recognised by class.

Importing TensorFlow or JAX to ask `isinstance` would load a framework the user does not run.
"""

from __future__ import annotations

from typing import Any

import keras


def is_foreign_tf_tensor(value: Any) -> bool:
    """Whether `value` is a dense TensorFlow tensor while Keras runs on another backend.

    Keras's `predict`/`evaluate` on JAX read such tensors as numpy arrays; keras_memfit does too.
    """
    cls = type(value)
    return (
        cls.__name__ == "EagerTensor"
        and cls.__module__.startswith("tensorflow")
        and keras.backend.backend() != "tensorflow"
    )


def is_sparse(value: Any) -> bool:
    """Whether `value` is a sparse tensor or matrix (`tf.SparseTensor`, scipy, JAX BCOO).

    keras_memfit cannot take rows of these: they go through Keras's own batching, run whole.
    """
    if type(value).__name__ in ("SparseTensor", "BCOO"):
        return True
    return hasattr(value, "tocsr") and hasattr(value, "nnz")  # scipy.sparse


def is_ragged(value: Any) -> bool:
    """Whether `value` is a `tf.RaggedTensor` (`model.predict` returns those as they are)."""
    return type(value).__name__ == "RaggedTensor"
