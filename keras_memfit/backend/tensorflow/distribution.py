"""TensorFlow's distribution: `tf.distribute` strategies in one process.

Inference splits each piece into one share per replica inside the step (`distributed_step`);
MemFit cuts each replica's rows of a Keras batch alike, as lanes (`Replicated`, `Lanes`).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Hashable, Iterable, List, Optional, Sequence, Tuple, Union

import keras
import numpy as np
import tensorflow as tf

from keras.src.backend.tensorflow.trainer import reduce_per_replica

from keras_memfit._internal import batches as _batches
from keras_memfit._internal import cache as _cache
from keras_memfit._internal import keras_compat as _keras_compat
from keras_memfit._internal import reductions as _reductions
from keras_memfit._internal.batches import as_batch, concatenate, first_unsplittable, form_of
from keras_memfit._internal.batches import splittable_rows
from keras_memfit.backend.base import StepOutcome
from keras_memfit.backend.tensorflow.accumulation import (
    add_gradients, apply_gradients, kept_rows_text, sparse_gradients, sums_sparse_exactly, zero,
)
from keras_memfit.backend.tensorflow.compiling import (
    compile_step, needs_static_batch, traced_as_keras,
)
from keras_memfit.backend.tensorflow.default_step import flagged_train_step, ordered_after

_HOST = "/CPU:0"


def active_strategy(model: Any) -> Optional[tf.distribute.Strategy]:
    """The `tf.distribute` strategy `model` runs under (as Keras's trainer finds it), or None."""
    strategy = getattr(model, "_distribute_strategy", None)
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
    """Where each replica's share of `rows` (int or scalar tensor) starts: (7, 2) -> [0, 4, 7]."""
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
    """`data` as one contiguous share of its rows per replica, cut on the host."""
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


def distributed_step(
    model: keras.Model,
    fn: Callable[[Any], Any],
    *,
    how: str,
    static_shapes: bool = False,
) -> Callable[[Any], Any]:
    """`fn` compiled as Keras's own; under a `MirroredStrategy` on every replica's share, outputs
    combined as `how` ("concat" or "mean") says."""
    strategy = strategy_of(model)
    if strategy is None:
        return compile_step(model, fn, static_shapes=static_shapes)
    eager = bool(getattr(model, "run_eagerly", False))
    inner = fn
    if not eager and model.jit_compile:
        inner = tf.function(fn, reduce_retracing=not static_shapes, jit_compile=True)

    def step(data: Any) -> Any:
        outputs = strategy.run(inner, args=(distribute(strategy, data),))
        with tf.device(_HOST):  # each per-replica output made one, as Keras's own loops do
            return reduce_per_replica(outputs, strategy, how)

    if eager:
        return step
    return tf.function(step, reduce_retracing=not static_shapes)


def variable_copies(variable: Any) -> Tuple[Any, ...]:
    """The per-replica `tf.Variable`s of a (Keras) variable; itself when not distributed."""
    value = variable._value if isinstance(variable, keras.Variable) else variable
    if isinstance(value, tf.distribute.DistributedValues):
        return tuple(value.values)
    return (value,)


class VariableGuard:
    """A `Guard` over every copy of some variables (one per replica under a strategy).

    The snapshot is one compiled read of the copies (a later update copies the buffer rather than
    overwrite it); each copy is restored on its own device, whatever strategy scope is active.
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
        if self._read is not None:
            self._saved = self._read()

    def restore(self) -> None:
        if self._saved is None:
            return
        for copy, value in zip(self._copies, self._saved):
            copy.assign(value)


_SUPPORTED = (tf.distribute.MirroredStrategy, tf.distribute.OneDeviceStrategy)


def check_strategy(strategy: Any) -> None:
    """Raise `NotImplementedError` for a strategy but `MirroredStrategy`, `OneDeviceStrategy`."""
    if isinstance(strategy, _SUPPORTED):
        return
    name = type(strategy).__name__
    received = f"Received: a model under {name}."
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        raise NotImplementedError(
            "MemFit does not support tf.distribute.MultiWorkerMirroredStrategy: Keras 3's "
            "own fit fails under it before any out-of-memory error (keras-team/keras#20585, "
            "'ValueError: Attempt to convert a value (PerReplica...)'). " + received
            + " Use tf.distribute.MirroredStrategy on one machine's devices."
        )
    if isinstance(strategy, (tf.distribute.TPUStrategy, tf.distribute.experimental.TPUStrategy)):
        raise NotImplementedError(
            "MemFit does not support tf.distribute.TPUStrategy: a TPU step is compiled "
            "for a fixed batch shape, which MemFit cannot split. " + received
            + " Train without MemFit, or with a smaller batch_size."
        )
    if isinstance(
        strategy,
        (tf.distribute.ParameterServerStrategy,
         tf.distribute.experimental.ParameterServerStrategy),
    ):
        raise NotImplementedError(
            "MemFit does not support tf.distribute.ParameterServerStrategy: its workers "
            "run steps asynchronously through a coordinator, outside the step functions "
            "MemFit replaces. " + received + " Train without MemFit."
        )
    raise NotImplementedError(
        "MemFit supports tf.distribute.MirroredStrategy and OneDeviceStrategy. "
        + received + " Use MirroredStrategy, or train without MemFit."
    )


def _local(strategy: tf.distribute.Strategy, value: Any) -> tuple:
    if value is None:
        return (None,) * strategy.num_replicas_in_sync
    return tuple(strategy.experimental_local_results(value))


def _per_replica(strategy: tf.distribute.Strategy, structure: Any) -> List[Any]:
    """A structure of distributed values as each replica's own structure, in replica order."""
    per_leaf = [_local(strategy, leaf) for leaf in keras.tree.flatten(structure)]
    return [
        keras.tree.pack_sequence_as(structure, [values[r] for values in per_leaf])
        for r in range(strategy.num_replicas_in_sync)
    ]


def _sync_on_read(strategy: tf.distribute.Strategy, initial: Any, dtype: Any = None) -> Any:
    with strategy.scope():
        return tf.Variable(
            initial, dtype=dtype, trainable=False,
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.SUM,
        )


class ReplicaTrainStep:
    """A train step on a distributed batch; after a failure `last_outcome` says whether a replica
    began its update (a per-replica flag, strict order), None for a custom `train_step`."""

    snapshots_itself = False

    def __init__(self, model: keras.Model, strategy: tf.distribute.Strategy, custom: bool) -> None:
        self.last_outcome: Optional[StepOutcome] = None
        self._custom = custom
        self._started = None if custom else _sync_on_read(strategy, 0, tf.int32)
        model_ref = weakref.ref(model)
        started = self._started

        def replica_step(data):
            model = model_ref()
            if custom:
                return model.train_step(data)
            data = ordered_after(started.assign(0), data)
            return flagged_train_step(model, data, lambda: started.assign(1), strict=True)

        def step(data):
            outputs = strategy.run(replica_step, args=(data,))
            return reduce_per_replica(outputs, strategy, "auto")

        self._step = traced_as_keras(compile_step(model, step))

    def __call__(self, data: Any) -> Dict[str, Any]:
        try:
            return self._step(data)
        except Exception:
            if not self._custom:
                began = int(self._started.read_value().numpy()) > 0
                self.last_outcome = StepOutcome.UPDATE_BEGAN if began else StepOutcome.RESTORED
            raise


class ReplicaAccumulator:
    """Sums each replica's weighted micro-batch gradients (`ON_READ` variables) and applies them
    as one optimizer step, all-reduced; sparse gradients kept as rows, as on one device."""

    def __init__(self, model: keras.Model, strategy: tf.distribute.Strategy) -> None:
        self._model = weakref.ref(model)
        self._strategy = strategy
        self._weights = list(model.trainable_weights)
        self._sums: Optional[List[Any]] = None  # per weight; None: a sparse gradient kept as rows
        self._kept: List[List[List[Any]]] = []  # per kept gradient, per replica: (values, indices)
        self._held: Optional[str] = None
        self._traced = {"mask": tuple(False for _ in self._weights)}

    def _make(self, data: Any) -> None:
        model, strategy, traced = self._model(), self._strategy, self._traced
        model_ref, weights = self._model, self._weights
        keeps_rows = not sums_sparse_exactly(model.optimizer)
        local = _per_replica(strategy, data)[0]
        sparse = sparse_gradients(model, local) if keeps_rows else [False] * len(self._weights)
        sums = self._sums = [
            None if kept else _sync_on_read(strategy, tf.zeros_like(w.value))
            for w, kept in zip(weights, sparse)
        ]
        rows = [i for i, total in enumerate(sums) if total is None]

        def replica_add(data, weight, loss_factor):
            kept = {}

            def add(i, g):
                if sums[i] is None:
                    kept[i] = (g.values, g.indices)
                else:
                    sums[i].assign_add(tf.convert_to_tensor(g))

            traced["mask"] = add_gradients(model_ref(), data, weight, loss_factor, add)
            return tuple(kept[i] for i in rows)

        def add(data, weight, loss_factor):
            return strategy.run(replica_add, args=(data, weight, loss_factor))

        def replica_apply(mask, kept):
            gradients = [None if missing or s is None else s.read_value()
                         for s, missing in zip(sums, mask)]
            for i, (values, indices) in zip(rows, kept):
                gradients[i] = tf.IndexedSlices(values, indices, tf.shape(weights[i].value))
            apply_gradients(model_ref(), gradients)

        def apply(mask, kept):
            strategy.run(replica_apply, args=(mask, kept))

        self._add = compile_step(model, add, static_shapes=needs_static_batch(model))
        self._apply = compile_step(model, apply)
        self._reset = tf.function(lambda: zero(sums))

    def reset(self) -> None:
        self._kept = []
        if self._sums is not None:
            self._reset()

    def add(self, data: Any, weight: Any, loss_factor: Any) -> None:
        """Add each replica's `weight` times its gradient on its rows (distributed values)."""
        if self._sums is None:
            self._make(data)
        kept = self._add(data, weight, loss_factor)
        if not self._kept:
            self._kept = [[[] for _ in range(self._strategy.num_replicas_in_sync)] for _ in kept]
        for pieces, (values, indices) in zip(self._kept, kept):
            for replica, pair in enumerate(zip(_local(self._strategy, values),
                                               _local(self._strategy, indices))):
                pieces[replica].append(pair)

    def held(self) -> Optional[str]:
        return self._held

    def apply(self) -> None:
        kept, self._kept = self._kept, []
        sparse = [i for i, total in enumerate(self._sums) if total is None]
        self._held = kept_rows_text(self._model().optimizer, [
            ([values for pieces in per_replica for values, _ in pieces], self._weights[i])
            for i, per_replica in zip(sparse, kept)
        ])
        joined = []
        for replica, device in enumerate(self._strategy.extended.worker_devices):
            with tf.device(device):  # each replica's rows, in order, on its device
                joined.append(tuple(
                    (tf.concat([v for v, _ in per_replica[replica]], 0),
                     tf.concat([i for _, i in per_replica[replica]], 0))
                    for per_replica in kept
                ))
        del kept
        rows = () if not joined[0] else self._strategy.experimental_distribute_values_from_function(
            lambda context: joined[context.replica_id_in_sync_group])
        self._apply(self._traced["mask"], rows)


class Lanes:
    """A distributed Keras batch as lanes: each replica's rows split alike (a `base.Cut`)."""

    def __init__(self, layout: "Replicated", batch: Any, local: List[tuple],
                 counts: List[int]) -> None:
        self.layout = layout
        self.distributed = batch
        self.form = form_of(batch)  # how Keras packed it: each replica's pieces alike
        self.local = local
        self.counts = counts
        self.lanes = max(counts)
        self.rows = sum(counts)
        largest = local[counts.index(self.lanes)]
        self.x = largest[0]
        # The chunk run_in_pieces splits: x with the largest replica's shapes
        # (stride-0 views, for the OutOfMemoryError's message), y the lanes.
        shapes = keras.tree.map_structure(
            lambda leaf: None if leaf is None
            else np.broadcast_to(np.zeros((), np.bool_), (self.lanes,) + tuple(leaf.shape[1:])),
            largest[0],
        )
        self.chunk = (shapes, np.arange(self.lanes), None)
        self.signature = (_batches.signature(largest[0]), "replicas", layout.count)

    def _parts(self, piece: tuple) -> List[tuple]:
        lanes = piece[1]
        a, b = (int(lanes[0]), int(lanes[-1]) + 1) if len(lanes) else (0, 0)
        return [
            _batches.rows(chunk, a * n // self.lanes, b * n // self.lanes)
            for chunk, n in zip(self.local, self.counts)
        ]

    def batch(self, piece: tuple) -> Any:
        if len(piece[1]) == self.lanes:
            return self.distributed  # the whole batch, as Keras distributed it
        return self.layout.distribute([as_batch(c, self.form) for c in self._parts(piece)])

    def micro_batch(self, piece: tuple, how: str) -> Tuple[Any, Any, Any]:
        chunks = self._parts(piece)  # each replica weighted in its own rows
        weights, factors = zip(*(
            _reductions.weights(how, part, whole) for part, whole in zip(chunks, self.local)))
        return (self.layout.distribute([as_batch(c, self.form) for c in chunks]),
                self.layout.scalars(weights), self.layout.scalars(factors))

    def rows_in(self, piece: tuple) -> int:
        return sum(_batches.num_rows(chunk) for chunk in self._parts(piece))

    def join(self, outputs: List[Any]) -> Any:
        return concatenate([
            concatenate([per_replica[r] for per_replica in outputs])
            for r in range(self.layout.count)
        ])


class Replicated:
    """MemFit's layout under a `MirroredStrategy` (or `OneDeviceStrategy`): a `base.Layout`."""

    def __init__(self, strategy: tf.distribute.Strategy) -> None:
        self.strategy = strategy
        self.count = int(strategy.num_replicas_in_sync)

    def local(self, batch: Any) -> List[tuple]:
        """Each replica's rows of a distributed Keras batch, as chunks."""
        return _per_replica(self.strategy, tuple(keras.utils.unpack_x_y_sample_weight(batch)))

    def distribute(self, chunks: List[Any]) -> Any:
        leaves = [keras.tree.flatten(c) for c in chunks]
        devices = self.strategy.extended.worker_devices

        def leaf(i):
            if leaves[0][i] is None:
                return None

            def value(context):
                r = context.replica_id_in_sync_group
                with tf.device(devices[r]):
                    return tf.identity(leaves[r][i])

            return self.strategy.experimental_distribute_values_from_function(value)

        return keras.tree.pack_sequence_as(chunks[0], [leaf(i) for i in range(len(leaves[0]))])

    def scalars(self, values: Sequence[float]) -> Any:
        values = [float(v) for v in values]
        return self.strategy.experimental_distribute_values_from_function(
            lambda context: tf.constant(values[context.replica_id_in_sync_group], tf.float64)
        )

    copies = staticmethod(variable_copies)

    def cut(self, batch: Any) -> Optional[Lanes]:
        local = self.local(batch)
        counts = [splittable_rows(chunk) for chunk in local]
        return None if None in counts else Lanes(self, batch, local, counts)

    def unsplittable(self, batches: Iterable[Any]) -> Optional[str]:
        return first_unsplittable(chunk for batch in batches for chunk in self.local(batch))

    def prepare(self, model: keras.Model, cut: Lanes) -> None:
        x, y, sample_weight = _batches.rows(cut.local[0], 0, 1)
        with self.strategy.scope():
            _keras_compat.symbolic_build(model, (x, y, sample_weight))

    def train_step(self, model: keras.Model, custom: bool, cut: Lanes) -> "ReplicaTrainStep":
        return ReplicaTrainStep(model, self.strategy, custom)

    def accumulator(self, model: keras.Model) -> "ReplicaAccumulator":
        return ReplicaAccumulator(model, self.strategy)

    def test_step(self, model: keras.Model, cut: Lanes,
                  exact: bool) -> Tuple[Callable[[Any], Any], VariableGuard]:
        if not exact:
            self.prepare(model, cut)
        key = ("evaluate", exact, step_variant(model), tuple(id(v) for v in model.metrics_variables),
               bool(getattr(model, "run_eagerly", False)), model.jit_compile)
        return _cache.per_model(model, key, lambda: (
            self._test_step(model, exact), VariableGuard(model.metrics_variables)))

    def _test_step(self, model: keras.Model, exact: bool) -> Callable[[Any], Any]:
        model_ref = weakref.ref(model)
        strategy = self.strategy

        def step(data):
            outputs = strategy.run(lambda d: model_ref().test_step(d), args=(data,))
            return reduce_per_replica(outputs, strategy, "auto")

        compiled = compile_step(model, step, static_shapes=exact and needs_static_batch(model))
        return compiled if exact else traced_as_keras(compiled)

    def predict_step(self, model: keras.Model) -> Callable[[Any], List[Any]]:
        key = ("predict", step_variant(model), bool(getattr(model, "run_eagerly", False)),
               model.jit_compile)
        return _cache.per_model(model, key, lambda: self._predict_step(model))

    def _predict_step(self, model: keras.Model) -> Callable[[Any], List[Any]]:
        model_ref = weakref.ref(model)
        strategy = self.strategy

        def step(data):
            return strategy.run(lambda d: model_ref().predict_step(d), args=(data,))

        compiled = compile_step(model, step)
        return lambda data: _per_replica(strategy, compiled(data))


def training_layout(model: keras.Model) -> Optional[Replicated]:
    """`Replicated` under `model`'s strategy, or None without one."""
    strategy = active_strategy(model)
    if strategy is None:
        return None
    check_strategy(strategy)
    return Replicated(strategy)


def step_variant(model: Any) -> Hashable:
    """The strategy `model` runs under (its identity), or "one device"."""
    strategy = active_strategy(model)
    return "one device" if strategy is None else ("replicas", id(strategy))


def piece_multiple() -> int:
    """1: tf.distribute splits uneven batches itself."""
    return 1
