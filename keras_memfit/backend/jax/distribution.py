"""`keras.distribution.DataParallel`: keras_memfit's pieces laid out over the devices.

Under `keras.distribution.DataParallel` (JAX's single-controller data
parallelism), Keras lays every batch out along its first dimension over the
devices of the mesh's batch axis: each device holds `rows / devices` rows and
runs the same compiled step on them, and XLA sums the replicated weights'
gradients across the devices. A batch whose rows are not a multiple of the
number of devices cannot be laid out so (Keras itself raises JAX's
`IndivisibleError` on such a last batch).

keras_memfit's steps under such a distribution are wrapped here
(`ShardedStep`, `ShardedTrainStep`, `ShardedAccumulator`), where the step
factories of `steps` and `training` find `variant()` to be
`Variant.DATA_PARALLEL`, so that every piece runs as Keras runs a batch:

- The planner plans only piece sizes that are a multiple of the device count
  (`piece_multiple`): every device runs the same number of pieces, of the
  same size. A piece of one row per device that runs out of memory is final.
- Each piece is laid out with the distribution's data layout before the step
  runs (slicing a laid-out JAX array gathers the slice on every device).
- A piece whose rows are not a multiple (the last rows of an input whose
  length is not one): its largest multiple runs laid out, and the remaining
  rows (fewer than the devices) run replicated on every device, as a second
  call of the same step. Predict concatenates the two outputs; evaluate's
  metrics weight every row once either way (Keras's JAX metrics are per
  sample), and its logs are the second call's; gradient accumulation adds
  the two parts with their shares of the weight. A train step (one optimizer
  update per piece) runs the whole piece replicated instead, so the piece is
  still one update. Keras's own `fit` never hands such a batch over.

One limit no Python code can lift: a step with a cross-device collective
(evaluate's metric sums, training's gradient sums) whose memory runs out on
one device while another device reaches the collective. Measured on XLA's
CPU client (host devices sharing one address-space limit): the waiting device
gives up after 40 s and XLA aborts the process ("Termination timeout ...
Exiting to ensure a consistent program state"); Keras's own steps hold the
same collectives. On GPUs, whose devices each have their own memory and run
the same piece sizes, an out-of-memory error should strike every device
alike (reasoned, not measured: no multi-GPU machine was at hand); one device
with much less free memory than the others (another process on it) could
still leave the others waiting in the collective.

Whether a step is wrapped is decided when it is made, and steps are cached
per model: a model's steps first made outside the distribution's scope stay
unlaid (they run on every device whole, as before).

Other distributions are not split here: `ModelParallel` (and any other
`keras.distribution.Distribution`) leaves safe_predict and safe_evaluate as
they are (the pieces are fed unlaid, as host arrays) and is refused by
MemFit with `NotImplementedError` (`check_trainable`). Multi-process JAX
(`jax.distributed`, where each process feeds its own rows) runs each
process's rows on local copies of the state instead (`processes`,
`process_training`), laid out over the process's own devices with the same
`piece_multiple` and `split_rows`, but with no collective inside the
program (one partial gradient sum per device, summed with the other
processes' once per batch).
"""

from __future__ import annotations

import contextlib
import enum
from typing import Any, Callable, Iterator, Optional, Tuple

import jax
import jax.numpy as jnp
import keras
import numpy as np

from keras_memfit._internal import reductions as _reductions
from keras_memfit._internal.batches import as_chunk
from keras_memfit.backend.jax import processes
from keras_memfit.backend.jax import state as _state


def data_parallel() -> Optional[Any]:
    """The active single-process `keras.distribution.DataParallel`, or None.

    None without a distribution, under another kind of distribution, or in
    a multi-process JAX run (see `check_trainable`).

    Example:
        >>> with keras.distribution.DataParallel().scope():
        ...     assert data_parallel() is not None
    """
    distribution = keras.distribution.distribution()
    if not isinstance(distribution, keras.distribution.DataParallel):
        return None
    if jax.process_count() > 1:
        return None
    return distribution


class Variant(enum.Enum):
    """How keras_memfit's steps run under the active distribution (`variant()`)."""

    ONE_DEVICE = "one device"  # no DataParallel: every piece on one device, or whole on each
    DATA_PARALLEL = "data parallel"  # one process: pieces laid out over the devices (`Sharded*`)
    PROCESSES = "processes"  # DataParallel over several processes (`process_training`)


def variant() -> Variant:
    """The one choice the step factories make: how this distribution's steps run.

    Example:
        >>> with keras.distribution.DataParallel().scope():
        ...     variant()
        <Variant.DATA_PARALLEL: 'data parallel'>
    """
    if processes.multi_process():
        return Variant.PROCESSES if processes.is_data_parallel() else Variant.ONE_DEVICE
    return Variant.ONE_DEVICE if data_parallel() is None else Variant.DATA_PARALLEL


def piece_multiple() -> int:
    """Under a single-process `DataParallel`, the devices of the mesh's batch axis.

    Under `DataParallel` over several processes, this process's local
    devices (each process lays its own rows over them: `process_training`);
    1 without `DataParallel`.

    Example:
        >>> keras.distribution.set_distribution(keras.distribution.DataParallel())
        >>> piece_multiple()  # with two JAX devices
        2
    """
    if jax.process_count() > 1:
        several = keras.distribution.distribution()
        if not isinstance(several, keras.distribution.DataParallel):
            return 1
        mesh = several.device_mesh.backend_mesh
        return max(1, len(mesh.local_devices))
    distribution = data_parallel()
    if distribution is None:
        return 1
    mesh = distribution.device_mesh
    return int(mesh.shape[list(mesh.axis_names).index(distribution.batch_dim_name)])


def check_trainable(model: keras.Model) -> None:
    """Raise if MemFit cannot train `model` under the active `keras.distribution`.

    MemFit trains under `DataParallel` (or no distribution), in one process
    or several (`jax.distributed`: see `processes` and `process_training`).

    Raises:
        NotImplementedError: For `ModelParallel` or another distribution than
            `DataParallel`; the message names what was received.

    Example:
        >>> keras.distribution.set_distribution(keras.distribution.ModelParallel(...))
        >>> check_trainable(model)  # raises NotImplementedError
    """
    distribution = keras.distribution.distribution()
    if distribution is None:
        return
    if not isinstance(distribution, keras.distribution.DataParallel):
        raise NotImplementedError(
            "MemFit on JAX trains under keras.distribution.DataParallel only; received "
            f"model '{model.name}' under {type(distribution).__name__}. Train under "
            "DataParallel, or without MemFit."
        )


# ---------------------------------------------------------------- layouts
def batch_rows(data: Any) -> int:
    """The rows of a batch: its first array's leading dimension (0 with no array).

    Example:
        >>> batch_rows((x[:64], y[:64], None))
        64
    """
    for leaf in keras.tree.flatten(data):
        if leaf is not None:
            return int(np.shape(leaf)[0])
    return 0


def _as_array(leaf: Any) -> Any:
    return leaf if isinstance(leaf, (jax.Array, np.ndarray)) else np.asarray(leaf)


def _lay_out(data: Any, distribution: Any) -> Any:
    """Every array of `data` laid out as Keras lays out a batch (rows over the devices)."""

    def one(leaf: Any) -> Any:
        if leaf is None:
            return None
        leaf = _as_array(leaf)
        return jax.device_put(leaf, distribution.get_data_layout(leaf.shape).backend_layout)

    return keras.tree.map_structure(one, data)


def put(data: Any, sharding: Any) -> Any:
    """Every array of `data` put on the devices as `sharding` says (None stays None).

    Example:
        >>> put((x[:64], y[:64], None), sharding)  # rows laid out, or replicated
    """
    return keras.tree.map_structure(
        lambda leaf: None if leaf is None else jax.device_put(_as_array(leaf), sharding), data
    )


def _replicate(data: Any, distribution: Any) -> Any:
    """Every array of `data` copied whole onto every device of the mesh."""
    return put(data, jax.sharding.NamedSharding(
        distribution.device_mesh.backend_mesh, jax.sharding.PartitionSpec()
    ))


def split_rows(data: Any, multiple: int) -> Tuple[Optional[Any], Optional[Any], int, int]:
    """`(head, tail, head_rows, tail_rows)`: the largest multiple of `multiple` rows, the rest.

    A part with no rows is None. Also the split of the multi-process
    accumulator (`process_training`) over each process's local devices.

    Example:
        >>> split_rows((x[:203], y[:203]), 2)[2:]
        (202, 1)
    """
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
class ShardedStep:
    """A predict or test step whose pieces are laid out over the devices (see the module).

    Attributes:
        __wrapped__: The step it runs (`output_spec` traces that one).

    Example:
        >>> step = ShardedStep(PredictStep(model, None), concatenate_outputs)
        >>> step(x[:203])  # 202 rows laid out over two devices, 1 row on both
    """

    def __init__(self, step: Callable[[Any], Any], combine: Callable[[Any, Any], Any]) -> None:
        self.__wrapped__ = step
        self._distribution = data_parallel()
        self._combine = combine
        self._multiple = piece_multiple()

    def __call__(self, data: Any) -> Any:
        return self.start(data).wait()

    def start(self, data: Any) -> Any:
        """Start the step on `data`'s pieces (a `backend.base.StartedPiece`)."""
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


class ShardedTrainStep:
    """A `TrainStep` whose pieces are laid out over the devices; one update per piece.

    A piece whose rows are not a multiple of the devices runs replicated.

    Example:
        >>> step = ShardedTrainStep(TrainStep(model))
        >>> logs = step((x[:64], y[:64]))  # 32 rows on each of two devices
    """

    def __init__(self, step: Any) -> None:
        self.__wrapped__ = step
        self._distribution = data_parallel()
        self._multiple = piece_multiple()

    @property
    def snapshots_itself(self) -> bool:
        return self.__wrapped__.snapshots_itself

    @property
    def last_outcome(self) -> Any:
        return self.__wrapped__.last_outcome

    def _laid_out(self, data: Any) -> Any:
        if batch_rows(data) % self._multiple:
            return _replicate(data, self._distribution)
        return _lay_out(data, self._distribution)

    def __call__(self, data: Any) -> Any:
        return self.__wrapped__(self._laid_out(data))


class ShardedAccumulator:
    """An `Accumulator` whose micro-batches are laid out over the devices.

    A micro-batch whose rows are not a multiple of the devices is added as
    two parts, each with its own weights in the micro-batch
    (`_internal.reductions.weights`) times the micro-batch's.

    Example:
        >>> acc = ShardedAccumulator(GradientAccumulator(model))
        >>> acc.reset(); acc.add((x[:64], y[:64]), 1.0, 1.0); acc.apply()
    """

    def __init__(self, accumulator: Any) -> None:
        self.__wrapped__ = accumulator
        self._distribution = data_parallel()
        self._multiple = piece_multiple()
        self._how: Optional[str] = None  # the model's weighting, at the first micro-batch

    def reset(self) -> None:
        self.__wrapped__.reset()

    def add(self, data: Any, weight: float, loss_factor: float) -> None:
        if self._how is None:
            self._how = _reductions.weighting(self.__wrapped__.model)[0]
        head, tail, _, _ = split_rows(data, self._multiple)
        whole = as_chunk(data)
        for part, put in ((head, _lay_out), (tail, _replicate)):
            if part is not None:
                w, f = _reductions.weights(self._how, as_chunk(part), whole)
                self.__wrapped__.add(put(part, self._distribution), weight * w, loss_factor * f)

    def held(self) -> Optional[str]:
        return self.__wrapped__.held()

    def apply(self) -> None:
        self.__wrapped__.apply()


def training_replicas(model: keras.Model) -> None:
    """None: under `DataParallel` Keras hands MemFit whole global batches, and
    every piece is laid out over the devices by the steps (see this module's
    docstring); `check_trainable` refuses the other distributions."""
    check_trainable(model)
    return None


def distribution_of(model: keras.Model) -> Optional[str]:
    """The active `keras.distribution` ("keras.distribution.DataParallel"), with
    the process count when several."""
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
    """Under several processes: a failure posted (`processes.post_failure`), the metrics summed.

    The test step runs each process's own rows on its own devices with no
    collective (the replicated weights' local copies), so each process's
    metric variables hold its own rows' sums and counts (the evaluate began
    with `reset_metrics`); summed over the processes they are what Keras's
    multi-process evaluate holds.
    """
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
