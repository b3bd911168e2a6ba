"""Train steps that keep the model's state until they succeeded, and gradient accumulation.

MemFit's building blocks for the JAX backend. Keras's JAX trainer donates the
model's state to its compiled train step, so a step that runs out of memory
loses the model. Here every step reads the variables' values, runs Keras's
own functional `train_step(state, data)` compiled without donation, waits
for the result and only then writes the new state back: a step that raises
has touched nothing (`StepOutcome.UNTOUCHED`), so it can always be retried,
and callers need no `Guard` around it. The old and new weights and optimizer
slots coexist during the step (one extra copy of the training state).

Every returned object satisfies its protocol in `keras_memfit.backend.base`.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional, Union

import jax
import jax.numpy as jnp
import keras
from keras.src.backend.jax.trainer import JAXTrainer

from keras_memfit.backend.base import StepOutcome
from keras_memfit.backend.jax import distribution
from keras_memfit.backend.jax.steps import _compile, assign, values


def has_default_train_step(model: keras.Model) -> bool:
    """Whether `model` uses Keras's own `train_step` (no override)."""
    return getattr(type(model).train_step, "__code__", None) is JAXTrainer.train_step.__code__


def uses_distribution(model: keras.Model) -> bool:
    """False: MemFit trains under a single-process `keras.distribution.DataParallel`.

    For any other `keras.distribution` (ModelParallel, multi-process) this
    raises `NotImplementedError` itself, naming the JAX case (see
    `distribution.check_trainable`), rather than answering True for the
    caller's tf.distribute message.
    """
    distribution.check_trainable(model)
    return False


def train_state(model: keras.Model) -> List[List[Any]]:
    """The variables of Keras's JAX train state: trainable, non-trainable, optimizer, metrics."""
    optimizer = model.optimizer.variables if model.optimizer is not None else []
    return [
        list(model.trainable_variables),
        list(model.non_trainable_variables),
        list(optimizer),
        list(model.metrics_variables),
    ]


class TrainStep:
    """The model's `train_step(state, data)`, compiled without donation.

    Works for Keras's default step and for a model's own (JAX train steps
    are functional: `(state, data) -> (logs, state)`). The new state is
    written into the model's variables only once the step finished.

    Attributes:
        snapshots_itself: True: nothing is written before the step succeeded,
            so callers need no `Guard`.
        last_outcome: `StepOutcome.UNTOUCHED` after a call raised, else None.

    Example:
        >>> logs = make_train_step(model)((x[:64], y[:64]))
    """

    snapshots_itself = True

    def __init__(self, model: keras.Model) -> None:
        self._model_ref = weakref.ref(model)
        model_ref = self._model_ref

        def train_fn(trainable, non_trainable, optimizer, metrics, data):
            return model_ref().train_step((trainable, non_trainable, optimizer, metrics), data)

        self._step = _compile(model, train_fn)
        self.last_outcome: Optional[StepOutcome] = None

    def __call__(self, data: Any) -> Dict[str, Any]:
        groups = train_state(self._model_ref())
        try:
            logs, state = jax.block_until_ready(
                self._step(*(values(group) for group in groups), data)
            )
        except Exception:
            self.last_outcome = StepOutcome.UNTOUCHED
            raise
        for group, new in zip(groups, state):
            assign(group, new)
        return logs


def make_train_step(model: keras.Model) -> Union[TrainStep, distribution.ShardedTrainStep]:
    """A `TrainStep` running Keras's default `train_step`."""
    return distribution.sharded_train_step(TrainStep(model))


def make_custom_train_step(model: keras.Model) -> Union[TrainStep, distribution.ShardedTrainStep]:
    """A `TrainStep` running the model's own `train_step` (functional too on JAX)."""
    return distribution.sharded_train_step(TrainStep(model))


class GradientAccumulator:
    """Sums weighted micro-batch gradients and applies them as one optimizer step.

    The sums are JAX arrays the size of the trainable weights, made on the
    first `reset()` (only once a batch has had to be split). `add` computes
    the gradient of `weight` times the scaled loss of a micro-batch, as
    Keras's JAX `train_step` does (`compute_loss_and_updates`), updates the
    metrics as it does, and writes the metric and non-trainable state only
    once the micro-batch finished; `apply` runs the optimizer's
    `stateless_apply` once on the sums (one step: `iterations` + 1).

    Example:
        >>> acc = make_accumulator(model)
        >>> acc.reset(); acc.add((x[:32], y[:32]), 0.5); acc.add((x[32:], y[32:]), 0.5)
        >>> acc.apply()
    """

    def __init__(self, model: keras.Model) -> None:
        self._model_ref = weakref.ref(model)
        model_ref = self._model_ref
        self._sums: Optional[List[Any]] = None

        def add_fn(sums, trainable, non_trainable, optimizer, metrics, data, weight):
            model = model_ref()
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)

            def weighted_loss(trainable):
                loss, aux = model.compute_loss_and_updates(
                    trainable, non_trainable, metrics, x, y, sample_weight,
                    training=True, optimizer_variables=optimizer,
                )
                return loss * weight.astype(loss.dtype), aux

            (_, aux), grads = jax.value_and_grad(weighted_loss, has_aux=True)(trainable)
            unscaled_loss, y_pred, new_non_trainable, new_metrics = aux
            _, new_metrics = JAXTrainer._update_metrics_variables(
                model, new_metrics, unscaled_loss, x, y, y_pred, sample_weight
            )
            sums = [total + g.astype(total.dtype) for total, g in zip(sums, grads)]
            return sums, new_non_trainable, new_metrics

        def apply_fn(optimizer, sums, trainable):
            return model_ref().optimizer.stateless_apply(optimizer, sums, trainable)

        self._add = _compile(model, add_fn)
        self._apply = _compile(model, apply_fn)

    def reset(self) -> None:
        """Start a new batch: zero the sums."""
        model = self._model_ref()
        self._sums = [jnp.zeros(v.shape, v.dtype) for v in model.trainable_variables]

    def add(self, data: Any, weight: float) -> None:
        """Add `weight` times the gradient of the loss on micro-batch `data`."""
        trainable, non_trainable, optimizer, metrics = train_state(self._model_ref())
        sums, new_non_trainable, new_metrics = jax.block_until_ready(self._add(
            self._sums, values(trainable), values(non_trainable), values(optimizer),
            values(metrics), data, jnp.asarray(weight, jnp.float32),
        ))
        self._sums = sums
        assign(non_trainable, new_non_trainable)
        assign(metrics, new_metrics)

    def apply(self) -> None:
        """Apply the summed gradients as one optimizer step."""
        trainable, _, optimizer, _ = train_state(self._model_ref())
        new_trainable, new_optimizer = jax.block_until_ready(
            self._apply(values(optimizer), self._sums, values(trainable))
        )
        assign(trainable, new_trainable)
        assign(optimizer, new_optimizer)
        self._sums = None


def make_accumulator(
    model: keras.Model,
) -> Union[GradientAccumulator, distribution.ShardedAccumulator]:
    """A `GradientAccumulator` over `model`'s trainable weights."""
    return distribution.sharded_accumulator(GradientAccumulator(model))
