"""Keras's step functions in the torch trainer's calling convention (`function(batches)`)."""

from __future__ import annotations

from typing import Any, Callable, Iterator, List

import keras

from keras_memfit.backend.base import KerasCall, check_step_kind


def keras_call(model: keras.Model, kind: str, *args: Any) -> KerasCall:
    """`args`: `(data,)`, the list of batches Keras pulled."""
    check_step_kind(kind)
    (data,) = args
    return KerasCall(list(data))


def adapter_batches(adapter: Any) -> Iterator[Any]:
    """Keras's own torch data loader (`get_torch_dataloader`): torch tensors."""
    return iter(adapter.get_torch_dataloader())


def call_keras_function(
    model: keras.Model, kind: str, function: Callable[..., Any], batches: List[Any]
) -> Any:
    return function(list(batches))


def is_end_of_data(exc: BaseException) -> bool:
    return isinstance(exc, StopIteration)

