"""keras_memfit: Keras without GPU out-of-memory errors.

Public API:
    safe_predict: `model.predict` that adapts its batch instead of dying of OOM.
    safe_evaluate: `model.evaluate` that adapts its batch, counting each sample once.
    is_oom_error: Whether an exception reports running out of memory.
    OutOfMemoryError: Raised when even a single sample does not fit.
"""

from keras_memfit.evaluate import safe_evaluate
from keras_memfit.oom import OutOfMemoryError, is_oom_error
from keras_memfit.predict import safe_predict

__version__ = "0.1.0"

__all__ = [
    "OutOfMemoryError",
    "is_oom_error",
    "safe_evaluate",
    "safe_predict",
]
