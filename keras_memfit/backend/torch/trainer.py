"""Keras's step functions in the torch trainer's calling convention.

Keras's torch trainer calls `model.train_function(data)`,
`model.test_function(data)` and `model.predict_function(data)` with `data` a
list of the batches of one execution (always one: `steps_per_execution > 1`
is an error on torch): `[(x, y)]` from `fit` (`[(x, y, sample_weight)]`
from `train_on_batch`), `[(x,)]` from `predict`. `fit` makes its train
function before `on_train_begin` and reads `model.train_function` at every
step, so MemFit swaps it as it does on TensorFlow. The steps return the
logs (`{'loss': 0-d tensor, ...}`) or the outputs (torch tensors).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, List

import keras

_KINDS = ("train", "test", "predict")


def step_function(
    model: keras.Model,
    kind: str,
    run_batches: Callable[[List[Any]], Any],
) -> Callable[[Any], Any]:
    """A replacement for `model.<kind>_function` that runs `run_batches`.

    Args:
        model: The model whose function is replaced.
        kind: "train", "test" or "predict".
        run_batches: Runs a list of Keras batches; returns what Keras expects
            of the function (the logs; for "predict", the batches' outputs).

    Returns:
        `function(data)`, `data` the list of batches Keras pulled.

    Raises:
        ValueError: If `kind` is not one of the three.

    Example:
        >>> model.train_function = step_function(model, "train", run.train)
    """
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {list(_KINDS)}; received kind={kind!r}")

    def function(data):
        return run_batches(list(data))

    return function


def adapter_batches(adapter: Any) -> Iterator[Any]:
    """The batches of a Keras data adapter, as Keras's torch loops hand them to a step.

    Keras's own torch data loader (`get_torch_dataloader`): torch tensors.
    """
    return iter(adapter.get_torch_dataloader())


def call_keras_function(
    model: keras.Model, kind: str, function: Callable[..., Any], batches: List[Any]
) -> Any:
    """Keras's own torch `<kind>_function` on `batches` (those MemFit cannot split).

    Example:
        >>> logs = call_keras_function(model, "train", keras_train_function, batches)
    """
    return function(list(batches))


def is_end_of_data(exc: BaseException) -> bool:
    """Whether `exc` is how an epoch's iterator says it has no batch left."""
    return isinstance(exc, StopIteration)


def materialize(model: Any) -> None:
    """Nothing: the model's variables hold its state inside Keras's loops too."""
