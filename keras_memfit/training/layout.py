"""MemFit's layout of a batch on one device: a batch is its rows, a piece a run of them.

A backend with replicas gives its own layout (`training_layout`); `layout_of` picks.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, List, Optional, Tuple

import keras

from keras_memfit import backend as _backend
from keras_memfit._internal import batches as _batches
from keras_memfit._internal import reductions as _reductions
from keras_memfit._internal.batches import (
    as_batch, as_chunk, concatenate, first_unsplittable, form_of, splittable_rows,
)
from keras_memfit.analysis import training_peak
from keras_memfit.backend.base import Accumulator, Guard, Layout, TrainStep
from keras_memfit.inference.steps import predict_step, test_step_and_guard


class Rows:
    """A batch on one device (a `Cut`): its rows."""

    __slots__ = ("chunk", "form", "lanes", "rows", "signature", "x")

    def __init__(self, chunk: tuple, form: int, rows: int) -> None:
        self.chunk = chunk
        self.form = form  # how Keras packed the batch: every piece alike
        self.lanes = self.rows = rows
        self.x = chunk[0]
        self.signature = _batches.signature(chunk[0])

    def batch(self, piece: tuple) -> Any:
        return as_batch(piece, self.form)

    def micro_batch(self, piece: tuple, how: str) -> Tuple[Any, Any, Any]:
        return (as_batch(piece, self.form), *_reductions.weights(how, piece, self.chunk))

    def rows_in(self, piece: tuple) -> int:
        return _batches.num_rows(piece)

    def join(self, outputs: List[Any]) -> Any:
        return concatenate(outputs)


class OneDevice:
    """The identity layout: a batch is its rows, run by the backend's own steps."""

    copies = None  # every variable has one copy

    def cut(self, batch: Any) -> Optional[Rows]:
        chunk = as_chunk(batch)
        n = splittable_rows(chunk)
        return None if n is None else Rows(chunk, form_of(batch), n)

    def unsplittable(self, batches: Iterable[Any]) -> Optional[str]:
        return first_unsplittable(as_chunk(batch) for batch in batches)

    def prepare(self, model: keras.Model, cut: Rows) -> None:
        """Build the model, its metrics, loss and optimizer before a train step is made."""
        _backend.get().prepare_test(model, _batches.rows(cut.chunk, 0, 1))

    def train_step(self, model: keras.Model, custom: bool, cut: Rows) -> TrainStep:
        backend = _backend.get()
        if custom:  # built as Keras builds it: by the step itself, on Keras's batch
            return backend.make_custom_train_step(model, cut.batch(cut.chunk))
        return backend.make_train_step(model, training_peak(model))

    def accumulator(self, model: keras.Model) -> Accumulator:
        return _backend.get().make_accumulator(model)

    def test_step(self, model: keras.Model, cut: Rows,
                  exact: bool) -> Tuple[Callable[[Any], Any], Guard]:
        """The test step (traced as Keras's unless `exact`) and its guard."""
        return test_step_and_guard(model, cut.chunk, exact=exact)

    def predict_step(self, model: keras.Model) -> Callable[[Any], Any]:
        step = predict_step(model)
        return lambda batch: step(as_chunk(batch)[0])


def layout_of(model: keras.Model) -> Layout:
    """The backend's layout of `model`'s batches under a distribution, else `OneDevice`."""
    layout = _backend.get().training_layout(model)
    return OneDevice() if layout is None else layout
