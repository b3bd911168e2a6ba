"""What kind of tensor a value is, by class name: `isinstance` would import the framework."""

from __future__ import annotations

from typing import Any

import keras


def is_foreign_tf_tensor(value: Any) -> bool:
    """Whether `value` is a dense TF tensor on another backend (read as numpy, as Keras does)."""
    cls = type(value)
    return (
        cls.__name__ == "EagerTensor"
        and cls.__module__.startswith("tensorflow")
        and keras.backend.backend() != "tensorflow"
    )


def is_sparse(value: Any) -> bool:
    """Whether `value` is a sparse tensor or matrix (TF, scipy, JAX BCOO): never split."""
    if type(value).__name__ in ("SparseTensor", "BCOO"):
        return True
    return hasattr(value, "tocsr") and hasattr(value, "nnz")  # scipy.sparse


def is_ragged(value: Any) -> bool:
    """Whether `value` is a `tf.RaggedTensor` (`model.predict` returns those as they are)."""
    return type(value).__name__ == "RaggedTensor"
