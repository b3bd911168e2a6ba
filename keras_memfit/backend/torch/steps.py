"""Predict and test steps (eager, under `torch.no_grad()`), their traced outputs, and guards."""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, List, Optional, Sequence

import keras
import numpy as np
import torch

from keras.src.backend.torch.core import device_scope, to_torch_dtype

from keras_memfit._internal import keras_compat as _keras_compat
from keras_memfit.backend.base import NO_SPEC, model_of, spec_of_two_sizes
from keras_memfit.backend.torch import memory

logger = logging.getLogger("keras_memfit")


def to_tensors(data: Any) -> Any:
    """`data` with every numpy array as a torch tensor on Keras's device (None stays None)."""
    if type(data) is tuple and all(d is None or type(d) is torch.Tensor for d in data):
        return data  # from Keras's torch data loader

    def convert(leaf: Any) -> Any:
        if isinstance(leaf, (np.ndarray, np.generic)):
            return keras.ops.convert_to_tensor(leaf)
        return leaf

    return keras.tree.map_structure(convert, data)


class AfterOOM:
    """Empties PyTorch's CUDA cache before the next call once a call raised."""

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending = False

    def before_call(self) -> None:
        """Release the cache a failed call left."""
        if self._pending:
            self._pending = False
            memory.release_cached()

    def failed(self) -> None:
        self._pending = True


class _Step:
    """A subclass's `_run` on a model held weakly (eagerly; `output_spec` traces on "meta")."""

    def __init__(self, model: keras.Model) -> None:
        self._model_ref = weakref.ref(model)
        self._after_oom = AfterOOM()

    def __call__(self, data: Any) -> Any:
        self._after_oom.before_call()
        try:
            with torch.no_grad():
                return self._run(model_of(self._model_ref), to_tensors(data))
        except Exception:
            self._after_oom.failed()
            raise


class PredictStep(_Step):
    """`x -> outputs`: the model's `predict_step` (then `postprocess`), eagerly."""

    def __init__(self, model: keras.Model, postprocess: Optional[Callable]) -> None:
        super().__init__(model)
        self._postprocess = postprocess

    def _run(self, model: keras.Model, x: Any) -> Any:
        outputs = model.predict_step((x,))
        if self._postprocess is not None:
            outputs = self._postprocess(outputs)
        return outputs

    def spec(self, x: Any) -> Any:
        """Output structure of `self(x)`, traced on the "meta" device."""
        model = model_of(self._model_ref)
        mapping = meta_variables(model)

        def at(n: int) -> Any:
            with torch.no_grad(), device_scope("meta"):
                xs = keras.tree.map_structure(
                    lambda a: None if a is None else torch.empty(
                        (n,) + tuple(a.shape[1:]), dtype=torch_dtype(a.dtype), device="meta"),
                    x,
                )
                with keras.StatelessScope(state_mapping=mapping):
                    return self._run(model, xs)

        return spec_of_two_sizes(
            at(1), at(2),
            lambda leaf: np.dtype(keras.backend.standardize_dtype(leaf.dtype))
            if isinstance(leaf, torch.Tensor) else None)


def torch_dtype(dtype: Any) -> Any:
    """A torch or Keras dtype as torch's."""
    if isinstance(dtype, torch.dtype):
        return dtype
    return to_torch_dtype(keras.backend.standardize_dtype(dtype))


def meta_variables(model: keras.Model) -> List[tuple]:
    """`model`'s variables paired with empty tensors on "meta", for a `StatelessScope`."""
    return [(v, torch.empty(tuple(v.shape), dtype=v.value.dtype, device="meta"))
            for v in model.variables]


class TestStep(_Step):
    """`(x, y, sample_weight) -> logs`: the model's `test_step`, eagerly."""

    def _run(self, model: keras.Model, data: Any) -> Any:
        return model.test_step(data)


def make_predict_step(model: keras.Model, postprocess: Optional[Callable] = None) -> PredictStep:
    """Eager, under `torch.no_grad()`."""
    return PredictStep(model, postprocess)


KERAS_COUNTS_EACH_BATCH_ONCE = False  # eager: each batch weighted by its rows
KERAS_BEGINS_BATCH_BEFORE_FETCH = False


def make_test_step(model: keras.Model, exact: bool = False) -> TestStep:
    """Eager, under `torch.no_grad()` (`exact` changes nothing)."""
    return TestStep(model)


class TensorsOf:
    """The torch tensors behind a list of Keras variables, looked up again only when it changes."""

    __slots__ = ("_variables", "_tensors")

    def __init__(self) -> None:
        self._variables: tuple = ()
        self._tensors: List[Any] = []

    def __call__(self, variables: Sequence[Any]) -> List[Any]:
        known = self._variables
        if len(variables) != len(known) or any(a is not b for a, b in zip(variables, known)):
            self._variables = tuple(variables)
            self._tensors = [v.value for v in variables]
        return self._tensors


class VariableGuard:
    """A `Guard`: copies of some variables, taken before a step, restored if it fails."""

    def __init__(self, variables: Sequence[Any]) -> None:
        self._variables = list(variables)
        self._tensors = TensorsOf()
        self._saved: Optional[List[Any]] = None

    def snapshot(self) -> None:
        values = self._tensors(self._variables)
        with torch.no_grad():
            if self._saved is None:
                self._saved = [v.detach().clone() for v in values]
            elif values:
                torch._foreach_copy_(self._saved, values)

    def restore(self) -> None:
        if self._saved is None:
            return
        with torch.no_grad():
            for value, saved in zip(self._tensors(self._variables), self._saved):
                value.copy_(saved)


def guard_variables(variables: Sequence[Any]) -> VariableGuard:
    return VariableGuard(variables)


def prepare_test(model: keras.Model, batch: Any) -> None:
    x, y, sample_weight = batch
    _keras_compat.symbolic_build(model, (x, y, sample_weight))


def output_spec(step: Callable, x: Any) -> Any:
    """Traced on PyTorch's "meta" device at two batch sizes; `NO_SPEC` where the trace raises."""
    if not isinstance(step, PredictStep):
        step = getattr(step, "__wrapped__", None)  # a functools.wraps wrapper
    if not isinstance(step, PredictStep):
        return NO_SPEC
    try:
        return step.spec(x)
    except Exception as exc:  # noqa: BLE001 - no meta kernel
        logger.debug("safe_predict: no meta-device trace of the predict step (%s)", exc)
        return NO_SPEC
