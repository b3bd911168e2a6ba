"""`keras.distribution.DataParallel`: keras_memfit's pieces laid out over the devices.

Under a single-process `DataParallel` the step factories wrap their steps here (`Sharded*`).
A piece's rows beyond a multiple of the devices run replicated on every device as a second
call (a train step: the whole piece). Which variant steps run as: `variant()`.
"""

from __future__ import annotations

import contextlib
import enum
from typing import Any, Callable, Hashable, Iterator, Optional, Tuple

import jax
import jax.numpy as jnp
import keras
import numpy as np

from keras_memfit._internal import reductions as _reductions
from keras_memfit._internal.batches import as_chunk
from keras_memfit.backend.base import StepOutcome
from keras_memfit.backend.jax import processes
from keras_memfit.backend.jax import state as _state


def data_parallel() -> Optional[Any]:
    """The active single-process `keras.distribution.DataParallel`, or None."""
    distribution = keras.distribution.distribution()
    if jax.process_count() > 1 or not isinstance(distribution, keras.distribution.DataParallel):
        return None
    return distribution


class Variant(enum.Enum):
    """How keras_memfit's steps run under the active distribution (`variant()`)."""

    ONE_DEVICE = "one device"  # no DataParallel: every piece on one device, or whole on each
    DATA_PARALLEL = "data parallel"  # one process: pieces laid out over the devices (`Sharded*`)
    PROCESSES = "processes"  # DataParallel over several processes (`process_training`)


def variant() -> Variant:
    """How this distribution's steps run: the one choice the step factories make."""
    if processes.multi_process():
        return Variant.PROCESSES if processes.is_data_parallel() else Variant.ONE_DEVICE
    return Variant.ONE_DEVICE if data_parallel() is None else Variant.DATA_PARALLEL


def step_variant(model: keras.Model) -> Hashable:
    """`variant()` and, under a distribution, the devices of its mesh and its batch axis."""
    chosen = variant()
    if chosen is Variant.ONE_DEVICE:
        return chosen.value
    distribution = keras.distribution.distribution()
    devices = tuple(str(d) for d in np.asarray(distribution.device_mesh.devices).flat)
    return chosen.value, devices, distribution.batch_dim_name


def piece_multiple() -> int:
    """The batch axis's devices (several processes: this process's local devices), else 1."""
    distribution = keras.distribution.distribution()
    if not isinstance(distribution, keras.distribution.DataParallel):
        return 1
    mesh = distribution.device_mesh
    if jax.process_count() > 1:
        return max(1, len(mesh.backend_mesh.local_devices))
    return int(mesh.shape[list(mesh.axis_names).index(distribution.batch_dim_name)])


def check_trainable(model: keras.Model) -> None:
    """Raise `NotImplementedError` under a distribution other than `DataParallel`."""
    distribution = keras.distribution.distribution()
    if distribution is not None and not isinstance(distribution, keras.distribution.DataParallel):
        raise NotImplementedError(
            "MemFit on JAX trains under keras.distribution.DataParallel only; received "
            f"model '{model.name}' under {type(distribution).__name__}. Train under "
            "DataParallel, or without MemFit."
        )


# ---------------------------------------------------------------- layouts
def batch_rows(data: Any) -> int:
    """The rows of a batch: its first array's leading dimension (0 with no array)."""
    for leaf in keras.tree.flatten(data):
        if leaf is not None:
            return int(np.shape(leaf)[0])
    return 0


def _as_array(leaf: Any) -> Any:
    return leaf if isinstance(leaf, (jax.Array, np.ndarray)) else np.asarray(leaf)


def _lay_out(data: Any, distribution: Any) -> Any:
    """Every array of `data` laid out as Keras lays out a batch."""

    def one(leaf: Any) -> Any:
        if leaf is None:
            return None
        leaf = _as_array(leaf)
        return jax.device_put(leaf, distribution.get_data_layout(leaf.shape).backend_layout)

    return keras.tree.map_structure(one, data)


def put(data: Any, sharding: Any) -> Any:
    """Every array of `data` put on the devices as `sharding` says (None stays None)."""
    return keras.tree.map_structure(
        lambda leaf: None if leaf is None else jax.device_put(_as_array(leaf), sharding), data
    )


def _replicate(data: Any, distribution: Any) -> Any:
    """Every array of `data` copied whole onto every device of the mesh."""
    return put(data, jax.sharding.NamedSharding(
        distribution.device_mesh.backend_mesh, jax.sharding.PartitionSpec()
    ))


def split_rows(data: Any, multiple: int) -> Tuple[Optional[Any], Optional[Any], int, int]:
    """`(head, tail, head_rows, tail_rows)`: the largest multiple of `multiple` rows, the rest."""
    n = batch_rows(data)
    cut = n - n % multiple
    if cut == n:
        return data, None, n, 0

    def rows(start: int, stop: int) -> Any:
        return keras.tree.map_structure(
            lambda leaf: None if leaf is None else leaf[start:stop], data
        )

    head = rows(0, cut) if cut else None
    return head, rows(cut, n), cut, n - cut


# ------------------------------------------------------------------ steps
class _Sharded:
    """A step or accumulator (`__wrapped__`) laid out over the devices."""

    def __init__(self, wrapped: Any) -> None:
        self.__wrapped__ = wrapped
        self._distribution = data_parallel()
        self._multiple = piece_multiple()


class ShardedStep(_Sharded):
    """A predict or test step whose pieces are laid out over the devices."""

    def __init__(self, step: Callable[[Any], Any], combine: Callable[[Any, Any], Any]) -> None:
        super().__init__(step)
        self._combine = combine

    def __call__(self, data: Any) -> Any:
        return self.start(data).wait()

    def start(self, data: Any) -> Any:
        step, distribution = self.__wrapped__, self._distribution
        head, tail, _, _ = split_rows(data, self._multiple)
        if tail is None:
            return step.start(_lay_out(head, distribution))
        if head is None:
            return step.start(_replicate(tail, distribution))
        first = step.start(_lay_out(head, distribution))
        return _BothStarted(first, step.start(_replicate(tail, distribution)), self._combine)


class _BothStarted:
    """Two steps started one after the other on a piece's rows, waited for as one."""

    def __init__(self, first: Any, second: Any, combine: Callable[[Any, Any], Any]) -> None:
        self._first, self._second, self._combine = first, second, combine

    def wait(self) -> Any:
        first = self._first.wait()  # if it failed: the state before both is back
        try:
            second = self._second.wait()
        except BaseException:
            self._first.undo()  # the second put back the first's state: undo that too
            raise
        return self._combine(first, second)

    def undo(self) -> None:
        self._first.undo()


def concatenate_outputs(first: Any, second: Any) -> Any:
    """Predict outputs of consecutive rows, joined (non-array leaves: the first's)."""
    return jax.tree_util.tree_map(
        lambda a, b: jnp.concatenate([a, b]) if hasattr(a, "shape") else a, first, second
    )


def last_logs(first: Any, second: Any) -> Any:
    """Test logs of two consecutive calls: the second's (the metrics count both)."""
    return second


class ShardedTrainStep(_Sharded):
    """A `TrainStep` whose pieces are laid out over the devices; one update per piece."""

    @property
    def snapshots_itself(self) -> bool:
        return self.__wrapped__.snapshots_itself

    @property
    def last_outcome(self) -> Optional[StepOutcome]:
        return self.__wrapped__.last_outcome

    def __call__(self, data: Any) -> Any:
        lay_out = _replicate if batch_rows(data) % self._multiple else _lay_out
        return self.__wrapped__(lay_out(data, self._distribution))


class ShardedAccumulator(_Sharded):
    """An `Accumulator` whose micro-batches are laid out over the devices, in two parts where
    the rows are not a multiple, each weighted within the micro-batch."""

    def __init__(self, accumulator: Any) -> None:
        super().__init__(accumulator)
        self._how: Optional[str] = None  # the model's weighting, at the first micro-batch

    def add(self, data: Any, weight: float, loss_factor: float) -> None:
        if self._how is None:
            self._how = _reductions.weighting(self.__wrapped__.model)[0]
        head, tail, _, _ = split_rows(data, self._multiple)
        whole = as_chunk(data)
        for part, put in ((head, _lay_out), (tail, _replicate)):
            if part is not None:
                w, f = _reductions.weights(self._how, as_chunk(part), whole)
                self.__wrapped__.add(put(part, self._distribution), weight * w, loss_factor * f)

    def reset(self) -> None:
        self.__wrapped__.reset()

    def apply(self) -> None:
        self.__wrapped__.apply()

    def held(self) -> Optional[str]:
        return self.__wrapped__.held()


def training_layout(model: keras.Model) -> None:
    """None: Keras hands MemFit whole global batches, which the steps lay out."""
    check_trainable(model)
    return None


def distribution_of(model: keras.Model) -> Optional[str]:
    """The active `keras.distribution`'s name, with the process count when several."""
    distribution = keras.distribution.distribution()
    if distribution is None:
        return None
    name = f"keras.distribution.{type(distribution).__name__}"
    if jax.process_count() > 1:
        name += f" over {jax.process_count()} processes"
    return name


def replica_devices(model: Any) -> Tuple[str, ...]:
    """(): every piece is planned for `compute_device()` alone."""
    return ()


@contextlib.contextmanager
def evaluation(model: keras.Model) -> Iterator[None]:
    """Under several processes: a failure posted, the metric variables summed over them."""
    try:
        yield
    except Exception as exc:
        processes.post_failure(exc)  # several processes: the others stop at once
        raise
    metrics = _state.get(model, ("metrics",))[0]
    if variant() is not Variant.PROCESSES or not metrics:
        return
    processes.agree(0, f"the end of an evaluate of model {model.name!r}")
    summed = processes.all_sum(processes.local(metrics), metrics)
    _state.put(model, ("metrics",), (summed,))
