"""Running the inference steps on every replica of a `tf.distribute.MirroredStrategy`.

Each piece is split inside the compiled step into one contiguous share per replica, and the
outputs come back concatenated in input order. Other strategies run as without a strategy.
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
    """The `tf.distribute` strategy `model` runs under (as Keras's trainer finds it), or None."""
    strategy = _distribute_strategy(model)
    if strategy is None and tf.distribute.has_strategy():
        strategy = tf.distribute.get_strategy()
    return strategy


def distribution_of(model: Any) -> Optional[str]:
    """The `tf.distribute` strategy `model` runs under, named, or None."""
    strategy = active_strategy(model)
    return None if strategy is None else f"tf.distribute.{type(strategy).__name__}"


def strategy_of(model: Any) -> Optional[tf.distribute.MirroredStrategy]:
    """The `MirroredStrategy` `model` runs under (see `active_strategy`), or None."""
    strategy = active_strategy(model)
    return strategy if isinstance(strategy, tf.distribute.MirroredStrategy) else None


def short_name(device: str) -> str:
    """A full device name as "TYPE:index" ("/job:localhost/.../device:GPU:1" -> "GPU:1")."""
    spec = tf.DeviceSpec.from_string(device)
    return f"{(spec.device_type or 'CPU').upper()}:{spec.device_index or 0}"


def replica_devices(model: Any) -> Tuple[str, ...]:
    """The devices of `model`'s replicas ("GPU:0", ...); () without a `MirroredStrategy`."""
    strategy = strategy_of(model)
    if strategy is None:
        return ()
    return tuple(short_name(d) for d in strategy.extended.worker_devices)


def split_bounds(rows: Union[int, tf.Tensor], replicas: int) -> List[Any]:
    """Where each replica's share of `rows` rows starts, and the last one ends: (7, 2) -> [0, 4, 7].

    Contiguous shares, the larger ones first. `rows` may be a scalar tensor (a batch dimension
    unknown when tracing).
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

    Cut on the host, so that each replica's device receives only its own rows; ragged and sparse
    tensors are cut by rows; None leaves stay None.
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
    """Each per-replica leaf of `outputs` (what `strategy.run` returned) made one, on the host.

    Args:
        how: "concat" (predictions, in replica order) or "mean" (logs, as Keras's
            `reduce_per_replica` "auto" does for a test step).
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
    """`fn` run on every replica of `strategy`, each on its share; outputs combined as `how` says.

    Compiled as Keras compiles its own distributed steps: `fn` XLA-compiled under `jit_compile`,
    the whole a `tf.function` traced with an unknown batch dimension (once per piece size with
    `static_shapes`), eager for a model that runs eagerly.
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
    """Every replica's copy of some variables, snapshotted before a step and restored after.

    Each copy is restored on its own device, whatever strategy scope is active. The snapshot is one
    compiled read of all the copies (a later update copies the buffer rather than overwrite it).
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
