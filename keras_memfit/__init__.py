"""keras_memfit: Keras without GPU out-of-memory errors.

`safe_predict`, `safe_evaluate`, `safe_generate` and the `MemFit` callback adapt their batch
instead of dying of OOM; `memory_report` and `place` size and place a model before it runs;
`is_oom_error`, `OutOfMemoryError` and `ProcessFailed` report failures.
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


# Names load on first use: the CLI must set memory limits before TensorFlow starts.
def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'keras_memfit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(__all__))
