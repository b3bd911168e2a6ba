"""Every use of Keras's private API, in one place, with the range it was tested on.

keras_memfit reaches into Keras where no public API exists (its training
loop, its loss tracker, its symbolic build). Each such access is a function
here, so that a Keras release that moves something breaks one module, and
`TESTED_KERAS` says which releases CI checks.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import keras

# MemFit reaches into Keras's training loop; CI tests both ends of this range.
TESTED_KERAS = ((3, 12), (3, 15))


def keras_version() -> tuple:
    """Keras's (major, minor), or () when the version string is unusual."""
    try:
        return tuple(int(p) for p in keras.__version__.split(".")[:2])
    except ValueError:
        return ()


def all_layers(model: keras.Model) -> Iterable[Any]:
    """The model and every layer nested in it (`Layer._flatten_layers`)."""
    return model._flatten_layers(include_self=True, recursive=True)


# ---- Training (MemFit): Keras's training loop and train step ----
_warned_version = False


def warn_if_untested_keras() -> None:
    """Warn once per process (logger "keras_memfit") when Keras is outside `TESTED_KERAS`."""
    global _warned_version
    version = keras_version()
    if _warned_version or not version:
        return
    low, high = TESTED_KERAS
    if not low <= version <= high:
        _warned_version = True
        logging.getLogger("keras_memfit").warning(
            "keras_memfit: MemFit was tested with Keras %d.%d to %d.%d and reaches into "
            "Keras's training loop; Keras %s is outside that range.",
            *low, *high, keras.__version__,
        )


def tensorflow_train_step() -> Any:
    """Keras's own `train_step` for the TensorFlow backend (`TensorFlowTrainer.train_step`)."""
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    return TensorFlowTrainer.train_step


def distribute_strategy(model: keras.Model) -> Any:
    """The distribution strategy `model` was built under, or None (`_distribute_strategy`)."""
    return getattr(model, "_distribute_strategy", None)


def call_has_training_arg(model: keras.Model) -> bool:
    """Whether `model.call` takes a `training` argument (`_call_has_training_arg`)."""
    return bool(model._call_has_training_arg)


def compute_loss(model: keras.Model, x: Any, y: Any, y_pred: Any, sample_weight: Any) -> Any:
    """The training loss of one batch, as Keras's train step computes it (`_compute_loss`)."""
    return model._compute_loss(
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
    )


def loss_tracker(model: keras.Model) -> Any:
    """The metric that tracks the mean loss in the logs (`_loss_tracker`)."""
    return model._loss_tracker


def unscale_loss_for_distribution(loss: Any) -> Any:
    """The loss without the distribution strategy's scaling (as Keras's train step)."""
    from keras.src.losses import loss as loss_module

    return loss_module.unscale_loss_for_distribution(loss)
