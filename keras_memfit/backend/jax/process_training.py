"""MemFit's train step under several JAX processes: local gradients, agreement, one sum, one update.

Each local device adds its rows' gradient to its own partial sum and state copy (`shard_map`, no
collective), so an OOM is this process's own (docs/distributed.md). Integer non-trainable
variables (seed counters) keep the first local device's value.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional

import jax
import jax.numpy as jnp
import keras

from keras_memfit.backend.base import StepOutcome
from keras_memfit.backend.jax import distribution, processes
from keras_memfit.backend.jax import state as _state
from keras_memfit.backend.jax.accumulation import TRAIN_STATE, accumulation_programs


def _on_every_device(mesh: jax.sharding.Mesh, tail: bool) -> Callable[[Callable], Callable]:
    """A `wrap` for `accumulation_programs`: `add` on every device of `mesh`, each on its own row;
    with `tail` (rows replicated) only the first device keeps what it added."""
    axis = processes.LOCAL_AXIS
    per, whole = jax.sharding.PartitionSpec(axis), jax.sharding.PartitionSpec()

    def wrap(add_fn: Callable) -> Callable:
        def body(sums, trainable, non_trainable, optimizer, metrics, data, weight, loss_factor):
            own = jax.tree_util.tree_map(lambda a: a[0], (sums, non_trainable, metrics))
            new = add_fn(own[0], trainable, own[1], optimizer, own[2], data, weight, loss_factor)
            if tail:
                keep = jax.lax.axis_index(axis) == 0
                new = jax.tree_util.tree_map(
                    lambda n, o: jnp.where(keep, n, o.astype(n.dtype)), new, own)
            return jax.tree_util.tree_map(lambda a: a[None], new)

        # check_vma=False: else the replicated weights' gradient is summed over devices (a psum).
        return jax.shard_map(
            body, mesh=mesh,
            in_specs=(per, whole, per, whole, per, whole if tail else per, whole, whole),
            out_specs=(per, per, per), check_vma=False)

    return wrap


class ProcessAccumulator:
    """This process's weighted piece gradients; `apply` agrees, sums over processes, updates."""

    def __init__(self, model: keras.Model) -> None:
        self._model_ref = weakref.ref(model)
        self._mesh = processes.local_mesh()
        self._devices = int(self._mesh.devices.size)
        self._add, self._apply = accumulation_programs(
            model, _on_every_device(self._mesh, tail=False))
        self._add_tail, _ = accumulation_programs(
            model, _on_every_device(self._mesh, tail=True))
        self._sums: Optional[List[Any]] = None
        self._base: Optional[List[List[Any]]] = None  # the global state at `reset`
        self._weights: Optional[List[List[Any]]] = None  # trainable, optimizer, local copies
        self._metrics_before: List[Any] = []  # per device, at `reset`
        self._non_trainable: List[Any] = []  # per device
        self._metrics: List[Any] = []  # per device
        self._rows = [0] * self._devices  # each local device's rows of the batch
        self.update_began = False

    def reset(self) -> None:
        """Start a batch: zero the sums, take local copies of the state."""
        model, mesh = self._model_ref(), self._mesh
        self._sums = None
        self._base = _state.get(model, TRAIN_STATE)
        trainable, non_trainable, optimizer, metrics = self._base
        self._weights = processes.replicated_locally([trainable, optimizer], mesh)
        self._non_trainable = processes.per_device(non_trainable, mesh)
        self._metrics = self._metrics_before = processes.per_device(metrics, mesh)
        self._sums = [processes.zeros_per_device(v.shape, v.dtype, mesh) for v in trainable]
        self._rows = [0] * self._devices

    def add(self, data: Any, weight: float, loss_factor: float) -> None:
        """Add a piece's gradient weighted by its rows (`sum_over_batch_size`: checked)."""
        n = self._devices
        head, tail, head_rows, tail_rows = distribution.split_rows(data, n)
        if head is not None:
            self._run(self._add, distribution.put(
                head, processes.local_sharding(self._mesh, rows=True)), head_rows // n)
            self._rows = [rows + head_rows // n for rows in self._rows]
        if tail is not None:
            self._run(self._add_tail, distribution.put(
                tail, processes.local_sharding(self._mesh, rows=False)), tail_rows)
            self._rows[0] += tail_rows

    def _run(self, program: Any, data: Any, rows: int) -> None:
        """One `add` program over the local devices, `rows` a device."""
        trainable, optimizer = self._weights
        sums, non_trainable, metrics = jax.block_until_ready(program(
            self._sums, trainable, self._non_trainable, optimizer, self._metrics, data,
            jnp.asarray(rows, jnp.float32), jnp.asarray(1.0, jnp.float32),
        ))
        self._sums, self._non_trainable, self._metrics = list(sums), non_trainable, metrics

    def held(self) -> Optional[str]:
        """None: dense gradients."""
        return None

    def apply(self) -> None:
        """Agree with every process, sum over them, update the global state once."""
        model = self._model_ref()
        self.update_began = False
        total = sum(processes.agree(sum(self._rows), f"a train batch of model {model.name!r}"))
        shares = [rows / total if total else 0.0 for rows in self._rows]
        trainable, non_trainable, optimizer, metrics = self._base
        sums, self._sums = self._sums, None
        values = [processes.map_per_device(
            lambda i, s: s * jnp.asarray(1.0 / total, s.dtype), s) for s in sums]
        values += [processes.map_per_device(lambda i, new, old: new - old, new, old)
                   for new, old in zip(self._metrics, self._metrics_before)]
        floats = [i for i, v in enumerate(non_trainable) if jnp.issubdtype(v.dtype, jnp.floating)]
        values += [processes.map_per_device(
            lambda i, v: v * jnp.asarray(shares[i], v.dtype), self._non_trainable[j])
            for j in floats]
        like = list(trainable) + list(metrics) + [non_trainable[i] for i in floats]
        self.update_began = True
        summed = processes.all_sum(values, like)
        n_t, n_m = len(trainable), len(metrics)
        grads, deltas, averaged = summed[:n_t], summed[n_t:n_t + n_m], summed[n_t + n_m:]
        new_metrics = [old + delta for old, delta in zip(metrics, deltas)]
        new_non_trainable = processes.as_global(
            [processes.first_row(v) for v in self._non_trainable], non_trainable)
        for i, value in zip(floats, averaged):
            new_non_trainable[i] = value
        new_trainable, new_optimizer = jax.block_until_ready(
            self._apply(trainable, optimizer, grads))
        self._base = self._weights = None
        _state.put(model, TRAIN_STATE,
                   (new_trainable, new_non_trainable, new_optimizer, new_metrics))
        _state.materialize(model)  # the batch's metrics are read from the variables next


class ProcessTrainStep:
    """A `TrainStep` under several processes: the whole piece as one accumulated batch."""

    snapshots_itself = True

    def __init__(self, model: keras.Model) -> None:
        self._model_ref = weakref.ref(model)
        self._accumulator = ProcessAccumulator(model)
        self.last_outcome: Optional[StepOutcome] = None

    def __call__(self, data: Any) -> Dict[str, Any]:
        accumulator = self._accumulator
        try:
            accumulator.reset()
            accumulator.add(data, 1.0, 1.0)
            accumulator.apply()
        except Exception:
            self.last_outcome = (StepOutcome.UPDATE_BEGAN if accumulator.update_began
                                 else StepOutcome.UNTOUCHED)
            raise
        return self._model_ref().get_metrics_result()
