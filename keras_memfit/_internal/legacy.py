"""Recognising Keras 2 (`tf_keras`) objects, which keras_memfit does not support.

Old notebooks set `TF_USE_LEGACY_KERAS=1` (so `tf.keras` is `tf_keras`, Keras
2) or import `tf_keras` directly. Such a model is no `keras.Model` and its
`fit` drives callbacks through Keras 2's own interface, so keras_memfit cannot
work with it; `legacy_keras_error` gives the message that says so and what to
do. It looks only at the modules of the object's classes: it imports neither
`tf_keras` nor TensorFlow.
"""

from __future__ import annotations

from typing import Any, Optional

# Where Keras 2's classes live: the tf_keras package (TF 2.16+), the keras 2.x
# package (`keras.engine`, `keras.src.engine`), and TensorFlow's own copy.
_LEGACY_MODULES = (
    "tf_keras.",
    "keras.engine.",
    "keras.src.engine.",
    "tensorflow.python.keras.",
    "tensorflow.keras.",
)


def is_legacy_keras(obj: Any) -> bool:
    """Whether `obj` is a Keras 2 (`tf_keras`) object (a model, a layer, a callback...).

    Args:
        obj: Any object.

    Returns:
        True if one of its classes comes from Keras 2.

    Example:
        >>> is_legacy_keras(keras.Sequential())
        False
    """
    for cls in type(obj).__mro__:
        module = getattr(cls, "__module__", "") or ""
        if (module + ".").startswith(_LEGACY_MODULES):
            return True
    return False


def legacy_keras_error(obj: Any) -> Optional[str]:
    """The error message for a Keras 2 (`tf_keras`) object, or None for anything else.

    Args:
        obj: The object received (usually the model).

    Returns:
        A message naming what was received and how to switch to Keras 3, or
        None when `obj` is not a Keras 2 object.

    Example:
        >>> legacy_keras_error(keras.Sequential()) is None
        True
    """
    if not is_legacy_keras(obj):
        return None
    cls = type(obj)
    return (
        "keras_memfit supports Keras 3 only; tf_keras (Keras 2) is not supported. "
        f"Received: a {cls.__name__} from {cls.__module__} (Keras 2, as `tf.keras` "
        "gives when TF_USE_LEGACY_KERAS=1, or `import tf_keras`). Build the model "
        "with Keras 3: `import keras` and use `keras.Model`/`keras.Sequential`, and "
        "unset TF_USE_LEGACY_KERAS (or set it to 0) before TensorFlow is imported."
    )


def refuse(obj: Any) -> None:
    """Raise `TypeError` with `legacy_keras_error`'s message for a Keras 2 object.

    Args:
        obj: The object received (usually the model).

    Raises:
        TypeError: If `obj` is a tf_keras (Keras 2) object.

    Example:
        >>> refuse(keras.Sequential())  # a Keras 3 model: nothing happens
    """
    message = legacy_keras_error(obj)
    if message is not None:
        raise TypeError(message)
