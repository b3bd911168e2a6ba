"""keras_memfit: Keras without GPU out-of-memory errors.

Public API:
    safe_predict: `model.predict` that adapts its batch instead of dying of OOM.
    safe_evaluate: `model.evaluate` that adapts its batch, counting each sample once.
    safe_generate: KerasHub's `causal_lm.generate` in batches that fit.
    MemFit: Callback that keeps `fit` running when a batch does not fit.
    is_oom_error: Whether an exception reports running out of memory.
    OutOfMemoryError: Raised when running smaller cannot avoid an OOM (its `cause` says why).
    ProcessFailed: Raised in every process of a multi-process JAX run when one failed or timed out.
    memory_report: Per-layer memory, FLOPs and devices of a model, before it runs.
    place: Pin oversized embedding/input layers to `/CPU:0`, the rest on the accelerator.

The names load on first use, so that `python -m keras_memfit` and `--help` do not
import TensorFlow (the demo must set memory limits before TensorFlow starts).
"""

import importlib
from typing import TYPE_CHECKING, Any, List

__version__ = "0.1.0"

_EXPORTS = {
    "MemFit": "keras_memfit.callbacks",
    "OutOfMemoryError": "keras_memfit.oom",
    "ProcessFailed": "keras_memfit.backend.base",
    "is_oom_error": "keras_memfit.oom",
    "memory_report": "keras_memfit.report",
    "place": "keras_memfit.placement",
    "safe_evaluate": "keras_memfit.evaluate",
    "safe_generate": "keras_memfit.generate",
    "safe_predict": "keras_memfit.predict",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # for type checkers and IDEs; at run time, see __getattr__
    from keras_memfit.backend.base import ProcessFailed
    from keras_memfit.callbacks import MemFit
    from keras_memfit.evaluate import safe_evaluate
    from keras_memfit.generate import safe_generate
    from keras_memfit.oom import OutOfMemoryError, is_oom_error
    from keras_memfit.placement import place
    from keras_memfit.predict import safe_predict
    from keras_memfit.report import memory_report


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'keras_memfit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(__all__))
