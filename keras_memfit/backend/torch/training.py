"""Train steps that can tell how far a failed call got, and gradient accumulation, on torch."""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence

import keras
import torch
import torch.utils.checkpoint

from keras_memfit._internal import keras_compat as _keras_compat
from keras_memfit._internal.model_state import train_state_variables
from keras_memfit.backend.base import StepOutcome
from keras_memfit.backend.torch.steps import AfterOOM, TensorsOf, VariableGuard, to_tensors


def _rows(x: Any) -> int:
    if type(x) is torch.Tensor:
        return int(x.shape[0])
    return int(next(i for i in keras.tree.flatten(x) if i is not None).shape[0])


def _forward_loss(
    model: keras.Model, x: Any, y: Any, sample_weight: Any, loss_factor: float = 1.0
) -> tuple:
    """Keras's torch train step up to the loss; the loss tracker gets it times `loss_factor`."""
    if _keras_compat.call_has_training_arg(model):
        y_pred = model(x, training=True)
    else:
        y_pred = model(x)
    loss = _keras_compat.compute_loss(model, x, y, y_pred, sample_weight)
    _keras_compat.loss_tracker(model).update_state(loss * loss_factor, sample_weight=_rows(x))
    return y_pred, loss


def _backward(
    model: keras.Model, data: Any, tensors: Sequence[Any], weight: Optional[float] = None,
    loss_factor: float = 1.0,
) -> tuple:
    """`(x, y, y_pred, sample_weight)` of Keras's step, after `backward()` (times `weight`)."""
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(to_tensors(data))
    _drop_grads(tensors)
    y_pred, loss = _forward_loss(model, x, y, sample_weight, loss_factor)
    if model.optimizer is not None:
        loss = model.optimizer.scale_loss(loss)
    if tensors:
        (loss if weight is None else loss * weight).backward()
    return x, y, y_pred, sample_weight


def drop_gradients(weights: Sequence[Any]) -> None:
    """Free the gradients `backward()` left on `weights` (`.grad = None`)."""
    _drop_grads([w.value for w in weights])


def _drop_grads(tensors: Sequence[Any]) -> None:
    for t in tensors:
        if t.grad is not None:  # reading is cheaper than setting
            t.grad = None


def _random_state() -> tuple:
    """torch's global generators' states: the CPU's, and the GPUs' once CUDA started."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_random_state(state: tuple) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


class TrainStep:
    """Keras's default torch train step, which can tell how far a failed call got.

    A failed call restores `guarded` and torch's global random state (unseeded dropout's).
    """

    snapshots_itself = True

    def __init__(self, model: keras.Model, guarded: Sequence[Any]) -> None:
        self._model_ref = weakref.ref(model)
        self._guard = VariableGuard(guarded)
        self._tensors = TensorsOf()
        self._after_oom = AfterOOM()
        self.last_outcome: Optional[StepOutcome] = None

    def __call__(self, data: Any) -> Dict[str, Any]:
        model = self._model_ref()
        self._after_oom.before_call()
        weights = model.trainable_weights
        tensors = self._tensors(weights)
        self._guard.snapshot()
        random_state = _random_state()
        began = False
        try:
            x, y, y_pred, sample_weight = _backward(model, data, tensors)
            if weights:
                gradients = [t.grad for t in tensors]
                began = True
                with torch.no_grad():
                    model.optimizer.apply(gradients, weights)
                del gradients
                _drop_grads(tensors)
            return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        except Exception:
            _drop_grads(tensors)
            self._guard.restore()
            _set_random_state(random_state)
            self.last_outcome = StepOutcome.UPDATE_BEGAN if began else StepOutcome.RESTORED
            self._after_oom.failed()
            raise


def make_train_step(
    model: keras.Model, peak_at: Optional[Callable[[int], Optional[int]]] = None
) -> TrainStep:
    """A `TrainStep` guarding `train_state_variables(model)` (`peak_at` unused: eager steps)."""
    return TrainStep(model, train_state_variables(model))


class CustomTrainStep:
    """A model's own `train_step`, run eagerly; callers guard the small state."""

    snapshots_itself = False
    last_outcome: Optional[StepOutcome] = None

    def __init__(self, model: keras.Model) -> None:
        self._model_ref = weakref.ref(model)
        self._after_oom = AfterOOM()

    def __call__(self, data: Any) -> Dict[str, Any]:
        model = self._model_ref()
        self._after_oom.before_call()
        try:
            return model.train_step(to_tensors(data))
        except Exception:
            drop_gradients(model.trainable_weights)
            self._after_oom.failed()
            raise


def checkpoint(fn: Callable) -> Callable:
    """Torch's non-reentrant `checkpoint` over `fn` (it keeps only `fn`'s inputs)."""
    return lambda *args: torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)


def make_custom_train_step(model: keras.Model, data: Any) -> CustomTrainStep:
    """A `CustomTrainStep` (Keras's `fit` built the model: `data` unused)."""
    return CustomTrainStep(model)


class GradientAccumulator:
    """Sums weighted micro-batch gradients in place and applies them as one optimizer step."""

    def __init__(self, model: keras.Model) -> None:
        self._model_ref = weakref.ref(model)
        self._sums: Optional[List[Optional[Any]]] = None
        self._after_oom = AfterOOM()

    def reset(self) -> None:
        """Start a new batch."""
        self._sums = None
        self._after_oom.before_call()

    def add(self, data: Any, weight: float, loss_factor: float) -> None:
        model = self._model_ref()
        weights = model.trainable_weights
        self._after_oom.before_call()
        try:
            tensors = [w.value for w in weights]
            x, y, y_pred, sample_weight = _backward(model, data, tensors, weight, loss_factor)
            if weights:
                self._add_gradients(weights)
            model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        except Exception:
            drop_gradients(weights)
            self._after_oom.failed()
            raise

    def _add_gradients(self, weights: Sequence[Any]) -> None:
        """Move the micro-batch's gradients into the sums (the first one's become them)."""
        with torch.no_grad():
            if self._sums is None:
                self._sums = [None] * len(weights)
            for i, w in enumerate(weights):
                grad, w.value.grad = w.value.grad, None
                if grad is None:
                    continue
                if self._sums[i] is None:
                    self._sums[i] = grad
                else:
                    self._sums[i].add_(grad)
                del grad

    def held(self) -> Optional[str]:
        return None

    def apply(self) -> None:
        """Apply the summed gradients as one optimizer step."""
        model = self._model_ref()
        weights = model.trainable_weights
        sums, self._sums = self._sums or [None] * len(weights), None
        try:
            with torch.no_grad():
                model.optimizer.apply(list(sums), weights)
        except Exception:
            self._after_oom.failed()
            raise
        finally:
            del sums


def make_accumulator(model: keras.Model) -> GradientAccumulator:
    return GradientAccumulator(model)
