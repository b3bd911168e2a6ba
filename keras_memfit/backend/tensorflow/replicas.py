"""Running the inference steps on every replica of a `tf.distribute.MirroredStrategy`.

A model built under a `MirroredStrategy`'s scope, or used inside one, runs
Keras's own predict and test steps with `strategy.run`: each replica gets a
share of the batch, predictions are concatenated in replica order, and the
metrics live per replica (Keras's metric variables are ON_READ: each replica
adds to its own copy, and reading sums the copies). keras_memfit's steps do
the same for every piece they run: the piece (a batch, or part of one after
an OOM) is split into one contiguous share per replica, as even as possible
(the first `rows % replicas` replicas get one row more, as `tf.data`'s
rebatching splits Keras's batches), inside the compiled step, and the
outputs come back concatenated in input order. The planner sizes the pieces
for all replicas at once (see `keras_memfit.planning.planner`): one size is agreed
before any replica runs it, so every replica runs the same number of pieces.

Other strategies (`OneDeviceStrategy`, `MultiWorkerMirroredStrategy`,
`TPUStrategy`, `ParameterServerStrategy`) are not recognised here: the steps
run as without a strategy, on the default device.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import keras
import tensorflow as tf


_HOST = "/CPU:0"


def _distribute_strategy(model: keras.Model) -> Any:
    """The distribution strategy `model` was built under, or None (`_distribute_strategy`)."""
    return getattr(model, "_distribute_strategy", None)


def active_strategy(model: Any) -> Optional[tf.distribute.Strategy]:
    """The `tf.distribute` strategy `model` runs under, of any kind, or None.

    As in Keras's own trainer: the strategy whose scope the model was
    created in, else the one whose scope is active now.
    """
    strategy = _distribute_strategy(model)
    if strategy is None and tf.distribute.has_strategy():
        strategy = tf.distribute.get_strategy()
    return strategy


def distribution_of(model: Any) -> Optional[str]:
    """The `tf.distribute` strategy `model` runs under, named, or None (see `active_strategy`).

    Example:
        >>> with tf.distribute.MirroredStrategy().scope():
        ...     model = build_model()
        >>> distribution_of(model)
        'tf.distribute.MirroredStrategy'
    """
    strategy = active_strategy(model)
    return None if strategy is None else f"tf.distribute.{type(strategy).__name__}"


def strategy_of(model: Any) -> Optional[tf.distribute.MirroredStrategy]:
    """The `MirroredStrategy` `model` runs under (see `active_strategy`), or None.

    Example:
        >>> with tf.distribute.MirroredStrategy().scope():
        ...     model = build_model()
        >>> strategy_of(model).num_replicas_in_sync  # on two GPUs
        2
    """
    strategy = active_strategy(model)
    return strategy if isinstance(strategy, tf.distribute.MirroredStrategy) else None


def short_name(device: str) -> str:
    """A full device name as "TYPE:index" ("/job:localhost/.../device:GPU:1" -> "GPU:1")."""
    spec = tf.DeviceSpec.from_string(device)
    return f"{(spec.device_type or 'CPU').upper()}:{spec.device_index or 0}"


def replica_devices(model: Any) -> Tuple[str, ...]:
    """The devices of `model`'s replicas ("GPU:0", "GPU:1"), or () without a `MirroredStrategy`.

    Example:
        >>> replica_devices(model)  # built under MirroredStrategy on two GPUs
        ('GPU:0', 'GPU:1')
    """
    strategy = strategy_of(model)
    if strategy is None:
        return ()
    return tuple(short_name(d) for d in strategy.extended.worker_devices)


def split_bounds(rows: Union[int, tf.Tensor], replicas: int) -> List[Any]:
    """Where each replica's share of `rows` rows starts, and where the last ends.

    Contiguous shares as even as possible, the larger ones first (replica
    `i` gets rows `bounds[i]:bounds[i + 1]`). `rows` may be a scalar tensor
    (a batch dimension unknown when tracing).

    Example:
        >>> split_bounds(7, 2)
        [0, 4, 7]
    """
    share, extra = rows // replicas, rows % replicas
    minimum = tf.minimum if tf.is_tensor(rows) else min
    return [i * share + minimum(i, extra) for i in range(replicas + 1)]


def _rows(data: Any) -> Union[int, tf.Tensor]:
    for leaf in keras.tree.flatten(data):
        if leaf is not None:
            static = leaf.shape[0]
            if static is not None:
                return int(static)
            if isinstance(leaf, tf.RaggedTensor):
                return tf.cast(leaf.nrows(), tf.int32)
            if isinstance(leaf, tf.SparseTensor):
                return tf.cast(leaf.dense_shape[0], tf.int32)
            return tf.shape(leaf)[0]
    return 0


def _share(leaf: Any, start: Any, stop: Any) -> Any:
    """Rows `start:stop` of a tensor, ragged or sparse tensor (None stays None)."""
    if leaf is None:
        return None
    if isinstance(leaf, tf.SparseTensor):
        rank = leaf.shape.rank
        begin = tf.stack([tf.cast(start, tf.int64)] + [tf.constant(0, tf.int64)] * (rank - 1))
        size = tf.concat([[tf.cast(stop - start, tf.int64)], leaf.dense_shape[1:]], axis=0)
        return tf.sparse.slice(leaf, begin, size)
    return leaf[start:stop]


def _as_tensor(leaf: Any) -> Any:
    if leaf is None or isinstance(leaf, (tf.Tensor, tf.RaggedTensor, tf.SparseTensor)):
        return leaf
    return tf.convert_to_tensor(leaf)


def distribute(strategy: tf.distribute.Strategy, data: Any) -> Any:
    """`data` (a structure of tensors sharing their rows) as one share per replica.

    The shares are cut on the host, so that each replica's device receives
    only its own rows; ragged and sparse tensors are cut by rows too. None
    leaves (optional inputs) stay None.
    """
    data = keras.tree.map_structure(_as_tensor, data)
    replicas = strategy.num_replicas_in_sync
    with tf.device(_HOST):
        bounds = split_bounds(_rows(data), replicas)

    def share(context: Any) -> Any:
        i = context.replica_id_in_sync_group
        with tf.device(_HOST):
            return keras.tree.map_structure(
                lambda leaf: _share(leaf, bounds[i], bounds[i + 1]), data
            )

    return strategy.experimental_distribute_values_from_function(share)


def _is_per_replica(value: Any) -> bool:
    return isinstance(value, tf.distribute.DistributedValues)


def _concat(parts: Sequence[Any]) -> Any:
    """Replicas' outputs as one, in replica order (Keras's `reduce_per_replica` "concat")."""
    if isinstance(parts[0], tf.SparseTensor):
        return tf.sparse.concat(axis=0, sp_inputs=list(parts))
    if parts[0].shape.rank == 0:
        return tf.stack(parts)
    return tf.concat(list(parts), axis=0)


def combine(strategy: tf.distribute.Strategy, outputs: Any, how: str) -> Any:
    """Each per-replica leaf of `outputs` made one, on the host.

    Args:
        strategy: The strategy that ran the step.
        outputs: What `strategy.run` returned.
        how: "concat" (predictions, in replica order) or "mean" (logs, as
            Keras's `reduce_per_replica` "auto" does for a test step).
    """

    def one(value: Any) -> Any:
        if not _is_per_replica(value):
            return value
        parts = strategy.experimental_local_results(value)
        if how == "concat":
            return _concat(parts)
        return tf.reduce_mean(tf.stack(list(parts)), axis=0)

    with tf.device(_HOST):
        return tf.nest.map_structure(one, outputs)


def distributed_step(
    model: keras.Model,
    strategy: tf.distribute.MirroredStrategy,
    fn: Callable[[Any], Any],
    *,
    how: str,
    static_shapes: bool = False,
) -> Callable[[Any], Any]:
    """`fn` run on every replica of `strategy`, each on its share of the batch.

    Compiled as Keras compiles its own distributed steps: the step on one
    replica is XLA-compiled when the model is (`jit_compile`), the whole
    (splitting, `strategy.run`, combining) is a `tf.function` traced with an
    unknown batch dimension, unless `static_shapes` (then once per piece
    size, so that each replica's share has a static size). A model that runs
    eagerly gets an eager step.

    Args:
        model: The model (for `run_eagerly` and `jit_compile`).
        strategy: The model's strategy (see `strategy_of`).
        fn: One replica's step on its share of the batch.
        how: How the replicas' outputs are combined (see `combine`).
        static_shapes: Trace once per piece size.

    Returns:
        A function of the whole batch returning the combined outputs.
    """
    eager = bool(getattr(model, "run_eagerly", False))
    inner = fn
    if not eager and model.jit_compile:
        inner = tf.function(fn, reduce_retracing=not static_shapes, jit_compile=True)

    def step(data: Any) -> Any:
        outputs = strategy.run(inner, args=(distribute(strategy, data),))
        return combine(strategy, outputs, how)

    if eager:
        return step
    return tf.function(step, reduce_retracing=not static_shapes)


def variable_copies(variable: Any) -> Tuple[Any, ...]:
    """The per-replica `tf.Variable`s of a (Keras) variable; itself when not distributed."""
    value = variable._value if isinstance(variable, keras.Variable) else variable
    if isinstance(value, tf.distribute.DistributedValues):
        return tuple(value.values)
    return (value,)


def has_distributed(variables: Sequence[Any]) -> bool:
    """Whether any of `variables` is a tf.distribute variable (one copy per replica)."""
    return any(
        _is_per_replica(v._value if isinstance(v, keras.Variable) else v) for v in variables
    )


class ReplicaGuard:
    """Copies of every replica's copy of some variables, taken before a step, restored after.

    A distributed variable has one copy per replica, which a step under
    `strategy.run` updates separately (the ON_READ metric variables hold a
    different partial sum on each replica): the guard snapshots and
    restores each copy on its own device, so the restored state is exactly
    the one before the step, whatever strategy scope is active. The
    snapshot is one compiled read of all the copies (a later update copies
    the buffer rather than overwrite the snapshot).
    """

    def __init__(self, variables: Sequence[Any]) -> None:
        self._copies = [c for v in variables for c in variable_copies(v)]
        self._saved: Optional[List[Any]] = None
        copies = self._copies

        @tf.function
        def read() -> List[Any]:
            return [c.read_value() for c in copies]

        self._read = read if copies else None

    def snapshot(self) -> None:
        """Record every copy's current value."""
        if self._read is not None:
            self._saved = self._read()

    def restore(self) -> None:
        """Put back the values recorded by the last `snapshot()`."""
        if self._saved is None:
            return
        for copy, value in zip(self._copies, self._saved):
            copy.assign(value)
