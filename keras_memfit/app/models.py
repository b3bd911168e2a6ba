"""Saved Keras models for `keras-memfit predict` and `report`: checked, then loaded."""

from __future__ import annotations

import os
from typing import Any, Optional

from keras_memfit.app.errors import PredictError, one_line


def check_model_file(path: str, shown: str) -> None:
    """Raise `PredictError` (naming `shown`) unless `path` can be a saved model; no TensorFlow."""
    import zipfile

    if os.path.isdir(path):
        raise PredictError(
            f"cannot load model {shown}: it is a folder (a SavedModel?); keras-memfit "
            "loads .keras and .h5 files with keras.saving.load_model"
        )
    if not os.path.isfile(path):
        raise PredictError(f"cannot load model {shown}: no such file")
    if path.lower().endswith(".keras") and not zipfile.is_zipfile(path):
        raise PredictError(f"cannot load model {shown}: not a .keras file (not a zip archive)")


def load_model(path: str, memory_limit_mb: Optional[int], *, compile: bool = False) -> Any:
    """Load a saved Keras model (in the child), or raise a one-line `PredictError`."""
    import keras

    from keras_memfit import is_oom_error

    name = os.path.basename(path)
    try:
        model = keras.saving.load_model(path, compile=compile)
    except Exception as err:  # any way a model file can fail to load
        hint = ""
        if memory_limit_mb is not None and is_oom_error(err):
            hint = f" (it does not fit in {memory_limit_mb} MiB)"
        raise PredictError(f"cannot load model {name}{hint}: {one_line(err)}") from err
    if not isinstance(model, keras.Model):
        raise PredictError(f"{name} holds a {type(model).__name__}, not a Keras model")
    return model
