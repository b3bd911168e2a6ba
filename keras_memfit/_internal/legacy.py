"""Recognising Keras 2 (`tf_keras`) objects by their classes' modules, importing neither."""

from __future__ import annotations

from typing import Any, Optional

# Keras 2's homes: tf_keras, keras 2.x (`keras.engine`, `keras.src.engine`), TensorFlow's copy.
_LEGACY_MODULES = (
    "tf_keras.",
    "keras.engine.",
    "keras.src.engine.",
    "tensorflow.python.keras.",
    "tensorflow.keras.",
)


def is_legacy_keras(obj: Any) -> bool:
    """Whether `obj` is a Keras 2 (`tf_keras`) object (a model, a layer, a callback...)."""
    modules = ((getattr(cls, "__module__", "") or "") + "." for cls in type(obj).__mro__)
    return any(module.startswith(_LEGACY_MODULES) for module in modules)


def legacy_keras_error(obj: Any) -> Optional[str]:
    """The error message for a Keras 2 object (how to switch to Keras 3), else None."""
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
    """Raise `TypeError` with `legacy_keras_error`'s message for a Keras 2 object."""
    message = legacy_keras_error(obj)
    if message is not None:
        raise TypeError(message)
