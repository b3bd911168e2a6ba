"""What kind of tensor a value is, across backends, recognised by class without importing any framework.

keras_memfit meets tensors of other frameworks than the active backend's:
TensorFlow tensors given to a model on JAX (Keras's adapters read them as
numpy), sparse inputs of every framework (`tf.SparseTensor`, JAX's `BCOO`,
scipy matrices), ragged outputs. Importing TensorFlow or JAX to ask
`isinstance` would load a framework the user does not run, so these
predicates read the class; they are the only place outside the backend
packages' own modules that names a framework's types.
"""

from __future__ import annotations

from typing import Any

import keras


def is_foreign_tf_tensor(value: Any) -> bool:
    """Whether `value` is a dense TensorFlow tensor while Keras runs on another backend.

    Keras's `predict`/`evaluate` on JAX accept such tensors as arrays (its
    array adapter reads them as numpy), so keras_memfit does too: `_to_array`
    reads them as numpy arrays, which the backend's steps take. Recognised by
    class, without importing TensorFlow.

    Example:
        >>> is_foreign_tf_tensor(tf.constant([[1.0]]))  # with KERAS_BACKEND=jax
        True
    """
    cls = type(value)
    return (
        cls.__name__ == "EagerTensor"
        and cls.__module__.startswith("tensorflow")
        and keras.backend.backend() != "tensorflow"
    )


def is_sparse(value: Any) -> bool:
    """Whether `value` is a sparse tensor or matrix (`tf.SparseTensor`, scipy, JAX BCOO).

    keras_memfit cannot take rows of these: they go through Keras's own
    batching, and a batch of them is run whole (see `rows`).
    """
    if type(value).__name__ in ("SparseTensor", "BCOO"):
        return True
    return hasattr(value, "tocsr") and hasattr(value, "nnz")  # scipy.sparse


def is_ragged(value: Any) -> bool:
    """Whether `value` is a `tf.RaggedTensor` (`model.predict` returns those as they are)."""
    return type(value).__name__ == "RaggedTensor"
