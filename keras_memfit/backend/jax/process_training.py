"""MemFit's train step under several JAX processes: local gradients, agreement, one sum, one update.

See `processes` for why no collective may run where memory can run out.
Under several processes (`processes.multi_process()`) with `DataParallel`,
the train step and the accumulator of the seam are the ones here:

- `ProcessAccumulator.add` computes, on this process's first device, the
  gradient of `rows` times the mean loss of a piece of this process's own
  rows (the batch Keras hands this process), on local copies of the
  replicated state, with no collective: an OOM there is this process's own,
  and the runner retries it smaller (all or nothing) without the others
  knowing; the metric and non-trainable updates stay local too;
- `ProcessAccumulator.apply` agrees with every process (`processes.agree`:
  each one's rows, bounded by the agreement's timeout), divides the local
  sums by the global batch's rows, and sums them over the processes
  (`processes.all_sum`, the batch's one collective) together with each
  metric variable's change and the row-weighted non-trainable floats; then
  the optimizer's update runs once on the global state, the same on every
  process.

So the update is the global batch's gradient as Keras's own multi-process
step computes it (the loss reduced with `sum_over_batch_size`, Keras's
default), up to summation order: the sum over processes of `rows_p / N`
times each process's mean gradient. Metrics made of sums and counts (Keras's
`Mean`, the loss tracker, most metrics) are exact; non-trainable floats
(BatchNormalization's moving statistics) are the row-weighted mean of each
process's update, which is exact for a moving mean and not for a moving
variance (each process's batch variance is about its own mean); integer
non-trainable variables (seed counters) keep this process's value, the same
on every process. A batch is one agreement whatever the pieces, so each
process may run its rows as different pieces.

Under several processes every step is accumulated (`mode="shrink"`, one
update per piece, would need every process to run the same number of
pieces: refused by `MemFit` through the seam's `process_count()`, as are
losses not reduced with `sum_over_batch_size`; a model's own `train_step` is
refused here, by `make_custom_train_step`).

`safe_predict` and `safe_evaluate` need no step of their own: their compiled
steps take the replicated weights and this process's rows as host arrays and
hold no collective, so each process computes its own rows (the outputs'
local copies hold them); an OOM there is retried on that process alone. A
standalone evaluate then sums the metric variables over the processes once
(`combine_process_metrics`).
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional, Union

import jax
import jax.numpy as jnp
import keras

from keras_memfit.backend.base import StepOutcome
from keras_memfit.backend.jax import distribution, processes
from keras_memfit.backend.jax import state as _state
from keras_memfit.backend.jax import training

TRAIN_STATE = training.TRAIN_STATE


def _is_float(value: Any) -> bool:
    return jnp.issubdtype(value.dtype, jnp.floating)


class ProcessAccumulator:
    """Sums this process's weighted piece gradients; `apply` agrees, sums over processes, updates.

    See the module docstring.

    Example:
        >>> acc = ProcessAccumulator(model)
        >>> acc.reset(); acc.add((x[:32], y[:32]), 0.5); acc.add((x[32:], y[32:]), 0.5)
        >>> acc.apply()  # every process calls it once per batch
    """

    def __init__(self, model: keras.Model) -> None:
        self._model_ref = weakref.ref(model)
        self._add, self._apply = training.accumulation_programs(model)
        self._sums: Optional[List[Any]] = None
        self._base: Optional[List[List[Any]]] = None  # the global state at `reset`
        self._local: Optional[List[List[Any]]] = None  # its local copies
        self._non_trainable: List[Any] = []
        self._metrics: List[Any] = []
        self._rows = 0
        self.update_began = False

    def reset(self) -> None:
        """Start a batch: zero the local sums, take local copies of the state."""
        model = self._model_ref()
        self._sums = None
        self._base = _state.get(model, TRAIN_STATE)
        self._local = processes.local(self._base)
        self._non_trainable, self._metrics = self._local[1], self._local[3]
        device = processes.local_device()
        self._sums = [jax.device_put(jnp.zeros(v.shape, v.dtype), device)
                      for v in self._local[0]]
        self._rows = 0

    def add(self, data: Any, weight: float) -> None:
        """Add the gradient of a piece of this process's rows (weighted by its rows)."""
        rows = distribution.batch_rows(data)
        device = processes.local_device()
        data = jax.tree_util.tree_map(lambda leaf: jax.device_put(leaf, device), data)
        trainable, _, optimizer, _ = self._local
        sums, non_trainable, metrics = jax.block_until_ready(self._add(
            self._sums, trainable, self._non_trainable, optimizer, self._metrics, data,
            jnp.asarray(rows, jnp.float32),
        ))
        self._sums, self._non_trainable, self._metrics = sums, non_trainable, metrics
        self._rows += rows

    def apply(self) -> None:
        """Agree with every process, sum over them, update the global state once."""
        model = self._model_ref()
        self.update_began = False
        everyone = processes.agree(self._rows, f"a train batch of model {model.name!r}")
        total = sum(everyone)
        share = self._rows / total if total else 0.0
        trainable, non_trainable, optimizer, metrics = self._base
        _, local_non_trainable, _, local_metrics = self._local
        sums, self._sums = self._sums, None
        values = [s * jnp.asarray(1.0 / total, s.dtype) for s in sums]
        like = list(trainable)
        values += [new - old for new, old in zip(self._metrics, local_metrics)]
        like += list(metrics)
        floats = [i for i, v in enumerate(non_trainable) if _is_float(v)]
        values += [self._non_trainable[i] * jnp.asarray(share, non_trainable[i].dtype)
                   for i in floats]
        like += [non_trainable[i] for i in floats]
        self.update_began = True
        summed = processes.all_sum(values, like)
        n_t, n_m = len(trainable), len(metrics)
        grads, deltas, averaged = summed[:n_t], summed[n_t:n_t + n_m], summed[n_t + n_m:]
        new_metrics = [old + delta for old, delta in zip(metrics, deltas)]
        new_non_trainable = processes.as_global(self._non_trainable, non_trainable)
        for i, value in zip(floats, averaged):
            new_non_trainable[i] = value
        new_trainable, new_optimizer = jax.block_until_ready(
            self._apply(trainable, optimizer, grads))
        self._base = self._local = None
        _state.put(model, TRAIN_STATE,
                   (new_trainable, new_non_trainable, new_optimizer, new_metrics))
        _state.materialize(model)  # the batch's metrics are read from the variables next


class ProcessTrainStep:
    """A `TrainStep` under several processes: the whole piece as one accumulated batch.

    Attributes:
        snapshots_itself: True (nothing is written before the agreement).
        last_outcome: After a call raised: `StepOutcome.UNTOUCHED`, or
            `StepOutcome.UPDATE_BEGAN` when the sum or the update failed.

    Example:
        >>> logs = ProcessTrainStep(model)((x_local, y_local))
    """

    snapshots_itself = True

    def __init__(self, model: keras.Model) -> None:
        self._model_ref = weakref.ref(model)
        self._accumulator = ProcessAccumulator(model)
        self.last_outcome: Optional[StepOutcome] = None

    def __call__(self, data: Any) -> Dict[str, Any]:
        accumulator = self._accumulator
        try:
            accumulator.reset()
            accumulator.add(data, 1.0)
            accumulator.apply()
        except Exception:
            self.last_outcome = (StepOutcome.UPDATE_BEGAN if accumulator.update_began
                                 else StepOutcome.UNTOUCHED)
            raise
        return self._model_ref().get_metrics_result()


def combine_process_metrics(model: keras.Model) -> None:
    """After a standalone evaluate: every metric variable summed over the processes.

    The test step runs each process's own rows on its own devices with no
    collective (the replicated weights' local copies), so each process's
    metric variables hold its own rows' sums and counts (the evaluate began
    with `reset_metrics`); summed over the processes they are what Keras's
    multi-process evaluate holds. One agreement, one sum; nothing with one
    process.

    Example:
        >>> combine_process_metrics(model)  # in every process, after the last batch
    """
    if not under_processes():
        return
    metrics = _state.get(model, ("metrics",))[0]
    if not metrics:
        return
    processes.agree(0, f"the end of an evaluate of model {model.name!r}")
    summed = processes.all_sum(processes.local(metrics), metrics)
    _state.put(model, ("metrics",), (summed,))


def under_processes() -> bool:
    """Whether MemFit trains across several processes (several of them, `DataParallel`).

    Example:
        >>> under_processes()  # one process
        False
    """
    return processes.multi_process() and processes.is_data_parallel()


def make_train_step(model: keras.Model) -> Union[ProcessTrainStep, Any]:
    """A `TrainStep` running Keras's default `train_step` (`ProcessTrainStep` under processes).

    Example:
        >>> logs = make_train_step(model)((x[:64], y[:64]))
    """
    if under_processes():
        return ProcessTrainStep(model)
    return training.make_train_step(model)


def make_custom_train_step(model: keras.Model) -> Any:
    """A `TrainStep` running the model's own `train_step` (refused under several processes).

    Raises:
        NotImplementedError: Under several processes, naming the model.

    Example:
        >>> logs = make_custom_train_step(model)((x[:64], y[:64]))
    """
    if under_processes():
        raise NotImplementedError(
            f"MemFit under several JAX processes trains Keras's default train_step only; "
            f"model '{model.name}' ({type(model).__name__}) has its own. Train it without "
            "MemFit, or in one process."
        )
    return training.make_custom_train_step(model)


def make_accumulator(model: keras.Model) -> Union[ProcessAccumulator, Any]:
    """An `Accumulator` over `model`'s weights (`ProcessAccumulator` under processes).

    Example:
        >>> acc = make_accumulator(model); acc.reset(); acc.add((x, y), 1.0); acc.apply()
    """
    if under_processes():
        return ProcessAccumulator(model)
    return training.make_accumulator(model)
