"""Gradient accumulation on JAX: micro-batch gradients summed in place, applied as one step."""

from __future__ import annotations

import weakref
from typing import Any, Callable, List, Optional, Tuple

import jax
import jax.numpy as jnp
import keras
from keras.src.backend.jax.trainer import JAXTrainer

from keras_memfit.backend.jax import state as _state
from keras_memfit.backend.jax.steps import _compile

TRAIN_STATE = _state.GROUPS["train"]


def gradients_and_metrics(model: keras.Model, trainable, non_trainable, optimizer, metrics,
                          data, weight: Any = None, loss_factor: Any = None) -> tuple:
    """Keras's JAX `train_step` without its update: `(grads, logs, non_trainable, metrics)`;
    the gradients of the loss times `weight`, the metrics of the loss times `loss_factor`."""
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)

    def loss_fn(trainable):
        loss, aux = model.compute_loss_and_updates(
            trainable, non_trainable, metrics, x, y, sample_weight,
            training=True, optimizer_variables=optimizer,
        )
        return (loss if weight is None else loss * weight.astype(loss.dtype)), aux

    (_, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
    unscaled_loss, y_pred, non_trainable, metrics = aux
    if loss_factor is not None:
        unscaled_loss = unscaled_loss * loss_factor.astype(unscaled_loss.dtype)
    logs, metrics = JAXTrainer._update_metrics_variables(
        model, metrics, unscaled_loss, x, y, y_pred, sample_weight
    )
    return grads, logs, non_trainable, metrics


def accumulation_programs(
    model: keras.Model, wrap: Optional[Callable[[Callable], Callable]] = None,
) -> Tuple[Any, Any]:
    """The compiled programs `(add, apply)`; `wrap` transforms `add`'s function before compiling."""
    model_ref = weakref.ref(model)

    def add_fn(sums, trainable, non_trainable, optimizer, metrics, data, weight, loss_factor):
        grads, _, new_non_trainable, new_metrics = gradients_and_metrics(
            model_ref(), trainable, non_trainable, optimizer, metrics, data, weight, loss_factor)
        sums = [total + g.astype(total.dtype) for total, g in zip(sums, grads)]
        return sums, new_non_trainable, new_metrics

    # The arguments in the order of the outputs (see `TrainStep`).
    def apply_fn(trainable, optimizer, sums):
        return model_ref().optimizer.stateless_apply(optimizer, sums, trainable)

    if wrap is not None:
        add_fn = wrap(add_fn)
    return (_compile(model, add_fn, donate_argnums=(0,)),
            _compile(model, apply_fn, donate_argnums=(0, 1)))


class GradientAccumulator:
    """An `Accumulator` on one device: an OOM in `add` may lose the sums, never the model's."""

    def __init__(self, model: keras.Model) -> None:
        self._model_ref = weakref.ref(model)
        self._sums: Optional[List[Any]] = None
        self._add, self._apply = accumulation_programs(model)

    @property
    def model(self) -> keras.Model:
        return self._model_ref()

    def reset(self) -> None:
        model = self._model_ref()
        self._sums = None  # before the new ones are made: never two sets at once
        self._sums = [jnp.zeros(v.shape, v.dtype) for v in model.trainable_variables]

    def add(self, data: Any, weight: float, loss_factor: float) -> None:
        model = self._model_ref()
        self._sums, new_non_trainable, new_metrics = jax.block_until_ready(self._add(
            self._sums, *_state.get(model, TRAIN_STATE), data,
            jnp.asarray(weight, jnp.float32), jnp.asarray(loss_factor, jnp.float32),
        ))
        _state.put(model, ("non_trainable", "metrics"), (new_non_trainable, new_metrics))

    def held(self) -> Optional[str]:
        """None: dense gradients."""
        return None

    def apply(self) -> None:
        model = self._model_ref()
        trainable, optimizer = _state.get(model, ("trainable", "optimizer"))
        sums, self._sums = self._sums, None
        new_trainable, new_optimizer = jax.block_until_ready(
            self._apply(trainable, optimizer, sums)
        )
        del sums
        _state.put(model, ("trainable", "optimizer"), (new_trainable, new_optimizer))
        _state.materialize(model)  # the batch's metrics are read from the variables next
