"""Train steps that keep the model's state until they succeeded, and gradient accumulation.

MemFit's building blocks for the JAX backend. Keras's JAX trainer donates the
model's state to its compiled train step, so a step that runs out of memory
loses the model. Here every step reads the model's state (Keras's state
tuple inside MemFit's train function, as Keras's own step does; see
`state`), runs Keras's own functional `train_step(state, data)` compiled
without donating it, waits for the result and only then writes the new
state: a step that raises has touched nothing (`StepOutcome.UNTOUCHED`), so
it can always be retried, and callers need no `Guard` around it. The old and
new weights and optimizer slots coexist during the step (one extra copy of
the training state). A step can also be started without waiting
(`TrainStep.start`) and settled later (`settle`), keeping the state it
started from until then, so that it overlaps the next step's dispatch as in
Keras's own loop (see `keras_memfit._deferred`).

Every returned object satisfies its protocol in `keras_memfit.backend.base`.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import jax
import jax.numpy as jnp
import keras
from keras.src.backend.jax.trainer import JAXTrainer

from keras_memfit.backend.base import StepOutcome
from keras_memfit.backend.jax import distribution
from keras_memfit.backend.jax import state as _state
from keras_memfit.backend.jax.oom import is_oom_error
from keras_memfit.backend.jax.steps import _compile

TRAIN_STATE = _state.GROUPS["train"]


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
    return [_state.variables(model, group) for group in TRAIN_STATE]


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

        def train_into_fn(trainable, non_trainable, optimizer, metrics, data, spare):
            return train_fn(trainable, non_trainable, optimizer, metrics, data)

        self._step = _compile(model, train_fn)
        self._compiled = self._step is not train_fn
        # The same step, writing its new state into the buffers of `spare`
        # (donated; unused otherwise): see `_spare_buffers`.
        self._step_into = (
            jax.jit(train_into_fn, donate_argnums=5, keep_unused=True)
            if self._compiled else None
        )
        self._spare: Optional[List[List[Any]]] = None
        # (the state it started from, what settles it waits for: see `_witness`)
        # per started, unsettled step, oldest first
        self._pending: List[Tuple[List[List[Any]], Any]] = []
        self._proven = False  # a step has run to its end (compiled, donation accepted)
        self.last_outcome: Optional[StepOutcome] = None

    @property
    def can_defer(self) -> bool:
        """Whether `start` may be used: once a step has run to its end (see `start`)."""
        return self._proven

    def __call__(self, data: Any) -> Dict[str, Any]:
        model = self._model_ref()
        current = _state.get(model, TRAIN_STATE)
        spare = self._spare_buffers(current)
        try:
            if spare is None:
                logs, state = jax.block_until_ready(self._step(*current, data))
            else:
                logs, state = self._run_into(current, data, spare)
        except Exception:
            self.last_outcome = StepOutcome.UNTOUCHED
            raise
        _state.put(model, TRAIN_STATE, state)
        self._spare = current  # superseded: its buffers can take a later step's state
        self._proven = True
        return logs

    def start(self, data: Any) -> Dict[str, Any]:
        """Start the step on `data` without waiting for it; `settle()` waits.

        The new state is the model's at once (the next step, or Keras, takes
        it as the input of what it dispatches next, as in Keras's own loop),
        while the state it started from is kept until the step is settled:
        if the step failed, `settle()` puts that back and raises. A step may
        be started while the one before is unsettled (its result is then the
        new step's input); the new state is then written into the buffers of
        the state two steps back, so three copies of the training state
        exist until the older step is settled (two when each step is settled
        before the next starts). Used once a step has run to its end
        (`can_defer`: compiled, its donation accepted), so what `settle()`
        can raise is what a computation raised (an OOM).

        Returns:
            The step's logs (arrays that may still be computing).
        """
        model = self._model_ref()
        current = _state.get(model, TRAIN_STATE)
        spare = self._spare_buffers(current)
        try:
            if spare is None:
                logs, state = self._step(*current, data)
            else:
                logs, state = self._step_into(*current, data, spare)
        except Exception:
            self.last_outcome = StepOutcome.UNTOUCHED
            raise
        _state.put(model, TRAIN_STATE, state)
        self._pending.append((current, self._witness(current, logs, state)))
        return logs

    def completion(self) -> Callable[[], bool]:
        """For the step started last: waits for its computation; whether it succeeded.

        Waits as a reader of Keras's own logs waits (for the arrays), on any
        thread, and changes nothing: the state is put back only by `settle`,
        on the thread that started the step.
        """
        witness = self._pending[-1][1]

        def succeeded() -> bool:
            try:
                jax.block_until_ready(witness)
            except Exception:  # what it raised is `settle`'s to handle
                return False
            return True

        return succeeded

    def _witness(self, current: List[List[Any]], logs: Any, state: Any) -> Any:
        """What `settle` waits for: one array the step's computation wrote, or all its outputs.

        A compiled step is one XLA computation: its outputs become ready
        together, and all carry its error if it failed. So waiting for one
        of them is waiting for the step, at a fraction of the cost of
        walking all of them (JAX returns an input the step passed through
        unchanged as the same array, which the computation did not write,
        so the array chosen is one that differs from the state it started
        from). A step that runs eagerly is many computations: all outputs.
        """
        if self._compiled:
            for old_group, group in zip(current, state):
                for old, new in zip(old_group, group):
                    if new is not old:
                        return new
        return (logs, state)

    def settle(self) -> None:
        """Wait for the oldest started step; if it failed, undo it and raise its error.

        Raises:
            Whatever the step's computation raised (an OOM). The model's
            state is then put back to where that step started
            (`StepOutcome.UNTOUCHED`), and the steps started after it, which
            took its result as their input, are dropped with it. The same
            when the wait is interrupted (KeyboardInterrupt): the state is
            as before the oldest started step.
        """
        if not self._pending:
            return
        current, witness = self._pending[0]
        try:
            jax.block_until_ready(witness)
        except BaseException:  # an interrupt too: the caller forgets every started step
            self._roll_back()
            raise
        del self._pending[0]
        self._spare = current  # superseded: its buffers can take a later step's state

    def _roll_back(self) -> None:
        """Put back the state the oldest started step began from; drop every started step."""
        current = self._pending[0][0]
        self._pending = []
        _state.put(self._model_ref(), TRAIN_STATE, current)
        self.last_outcome = StepOutcome.UNTOUCHED

    def _run_into(self, current: List[List[Any]], data: Any, spare: List[Any]) -> Any:
        try:
            return jax.block_until_ready(self._step_into(*current, data, spare))
        except Exception as exc:
            if is_oom_error(exc):
                raise
        # Not an OOM (a platform refusing the donation, say): `current` was not
        # donated, so run the plain step on it, and donate nothing from now on.
        self._step_into = None
        return jax.block_until_ready(self._step(*current, data))

    def _spare_buffers(self, current: List[List[Any]]) -> Optional[List[Any]]:
        """Arrays of a superseded state that only this step holds, to donate; or None.

        Keras's own step donates the state it is given, which an OOM then
        destroys; this step donates nothing of the current state. Without
        donation, though, every step allocates new buffers for the whole
        training state (on CPU that costs as much as a small model's step).
        So the state a step replaced is kept (`self._spare`) and, at the
        next step, its arrays are donated for the new state to be written
        into, as the buffers Keras's step would reuse: only arrays nothing
        else refers to (Python's reference count: not the current state, not
        the state Keras still holds, not a guard's snapshot, not a user's
        variable), so a failed step loses nothing but spare buffers.
        """
        spare, self._spare = self._spare, None
        if spare is None or self._step_into is None:
            return None
        buffers: List[Any] = []
        usable = False
        for old_group, group in zip(spare, current):
            if len(old_group) != len(group):
                return None
            for i in range(len(group)):  # no zip: its reused tuple would hold a reference
                old = old_group[i]
                if old is not group[i] and sys.getrefcount(old) <= _ONLY_HERE:
                    buffers.append(old)
                    usable = True
                else:
                    buffers.append(None)
        return buffers if usable else None


def _references_of_a_list_item() -> int:
    """`sys.getrefcount` of an object held only by one list, as `_spare_buffers` reads it."""
    group = [object()]
    item = group[0]
    return sys.getrefcount(item)


_ONLY_HERE = _references_of_a_list_item()


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
    `stateless_apply` once on the sums (one step: `iterations` + 1), then
    leaves the state in the model's variables (`state.materialize`), where
    Keras's `get_metrics_result` reads the batch's metrics.

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
        model = self._model_ref()
        sums, new_non_trainable, new_metrics = jax.block_until_ready(self._add(
            self._sums, *_state.get(model, TRAIN_STATE), data,
            jnp.asarray(weight, jnp.float32),
        ))
        self._sums = sums
        _state.put(model, ("non_trainable", "metrics"), (new_non_trainable, new_metrics))

    def apply(self) -> None:
        """Apply the summed gradients as one optimizer step."""
        model = self._model_ref()
        trainable, optimizer = _state.get(model, ("trainable", "optimizer"))
        new_trainable, new_optimizer = jax.block_until_ready(
            self._apply(optimizer, self._sums, trainable)
        )
        _state.put(model, ("trainable", "optimizer"), (new_trainable, new_optimizer))
        self._sums = None
        _state.materialize(model)  # the batch's metrics are read from the variables next


def make_accumulator(
    model: keras.Model,
) -> Union[GradientAccumulator, distribution.ShardedAccumulator]:
    """A `GradientAccumulator` over `model`'s trainable weights."""
    return distribution.sharded_accumulator(GradientAccumulator(model))
