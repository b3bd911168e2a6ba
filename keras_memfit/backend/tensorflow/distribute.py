"""MemFit's steps under a `tf.distribute` strategy: one piece on every replica at once.

`Replicas` lets `training.layout` split a distributed batch so that every replica runs the same
number of pieces (the optimizer's all-reduce must line up); its variables are made in the
strategy's scope.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence

import keras
import tensorflow as tf

from keras.src.backend.tensorflow.trainer import reduce_per_replica

from keras_memfit.backend.base import StepOutcome
from keras_memfit.backend.tensorflow.replicas import ReplicaGuard, active_strategy, variable_copies
from keras_memfit.backend.tensorflow.accumulation import (
    add_gradients, apply_gradients, kept_rows_text, sparse_gradients, sums_sparse_exactly,
)
from keras_memfit.backend.tensorflow.steps import _compile, _needs_static_batch, traced_as_keras
from keras_memfit.backend.tensorflow.training import flagged_train_step

_SUPPORTED = (tf.distribute.MirroredStrategy, tf.distribute.OneDeviceStrategy)


def check_strategy(strategy: Any) -> None:
    """Raise a clear `NotImplementedError` for a strategy MemFit cannot split for.

    Raises:
        NotImplementedError: For any strategy but `MirroredStrategy` and `OneDeviceStrategy`
            (multi-worker, TPU, parameter server, ...).
    """
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


def training_replicas(model: keras.Model) -> Optional["Replicas"]:
    """The `Replicas` of `model`'s strategy, or None without one (see `check_strategy`)."""
    strategy = active_strategy(model)
    if strategy is None:
        return None
    check_strategy(strategy)
    return Replicas(strategy)


def _local(strategy: tf.distribute.Strategy, value: Any) -> tuple:
    if value is None:
        return (None,) * strategy.num_replicas_in_sync
    return tuple(strategy.experimental_local_results(value))


class Replicas:
    """The replicas of a `MirroredStrategy` (or `OneDeviceStrategy`), for MemFit."""

    def __init__(self, strategy: tf.distribute.Strategy) -> None:
        self.strategy = strategy
        self.count = int(strategy.num_replicas_in_sync)

    def local(self, batch: Any) -> List[tuple]:
        """Each replica's rows of a distributed Keras batch, as `(x, y, sample_weight)` chunks."""
        chunk = tuple(keras.utils.unpack_x_y_sample_weight(batch))
        leaves = keras.tree.flatten(chunk)
        per_leaf = [_local(self.strategy, leaf) for leaf in leaves]
        return [
            keras.tree.pack_sequence_as(chunk, [values[r] for values in per_leaf])
            for r in range(self.count)
        ]

    def distribute(self, chunks: Sequence[Any]) -> Any:
        """One structure per replica (same structure) as one distributed value."""
        chunks = list(chunks)
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
        """One float per replica as a distributed float64 scalar."""
        values = [float(v) for v in values]
        return self.strategy.experimental_distribute_values_from_function(
            lambda context: tf.constant(values[context.replica_id_in_sync_group], tf.float64)
        )

    def copies(self, variable: Any) -> Sequence[Any]:
        """Each replica's copy of `variable` (a `tf.Variable` each)."""
        return variable_copies(variable)

    def guard(self, variables: Sequence[Any]) -> "ReplicaGuard":
        """A guard over every replica's copy of `variables`."""
        return ReplicaGuard(variables)

    def train_step(self, model: keras.Model, custom: bool) -> "ReplicaTrainStep":
        """The train step on a distributed batch (`model.train_step` when `custom`)."""
        return ReplicaTrainStep(model, self.strategy, custom)

    def accumulator(self, model: keras.Model) -> "ReplicaAccumulator":
        """A gradient accumulator over the replicas."""
        return ReplicaAccumulator(model, self.strategy)

    def test_step(self, model: keras.Model, exact: bool = False) -> Callable[[Any], Any]:
        """Keras's `model.test_step` on a distributed batch; returns the reduced logs.

        Traced as Keras traces its own (per-output loss trackers count a batch once); with `exact`,
        once per piece size (they weight a piece by its rows).
        """
        model_ref = weakref.ref(model)
        strategy = self.strategy

        def step(data):
            outputs = strategy.run(lambda d: model_ref().test_step(d), args=(data,))
            return reduce_per_replica(outputs, strategy, "auto")

        if exact:
            return _compile(model, step, static_shapes=_needs_static_batch(model))
        return traced_as_keras(_compile(model, step))

    def predict_step(self, model: keras.Model) -> Callable[[Any], List[Any]]:
        """`model.predict_step` on a distributed batch; returns each replica's outputs."""
        model_ref = weakref.ref(model)
        strategy = self.strategy

        def step(data):
            return strategy.run(lambda d: model_ref().predict_step(d), args=(data,))

        compiled = _compile(model, step)

        def run(data):
            outputs = compiled(data)
            flat = keras.tree.flatten(outputs)
            per_leaf = [_local(strategy, leaf) for leaf in flat]
            return [
                keras.tree.pack_sequence_as(outputs, [values[r] for values in per_leaf])
                for r in range(self.count)
            ]

        return run


def _sync_on_read(strategy: tf.distribute.Strategy, initial: Any, dtype: Any = None) -> Any:
    with strategy.scope():
        return tf.Variable(
            initial, dtype=dtype, trainable=False,
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.SUM,
        )


class ReplicaTrainStep:
    """A train step on a distributed batch that can tell whether its update began.

    Keras's default train step (or the model's own `train_step` when `custom`) under
    `strategy.run`; callers guard its small state. The default step sets a per-replica `ON_READ`
    flag once every gradient exists (always the strict order), so after a failed call
    `last_outcome` is `UPDATE_BEGAN` where a replica set it, else `RESTORED`; None for a custom
    `train_step` (unknown).
    """

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
            reset = started.assign(0)
            with tf.control_dependencies([reset]):
                data = keras.tree.map_structure(
                    lambda t: None if t is None else tf.identity(t), data
                )
            # The strict order (every gradient before the update): an OOM of a
            # replica's forward or backward pass stays retriable.
            return flagged_train_step(model, data, lambda: started.assign(1), strict=True)

        def step(data):
            outputs = strategy.run(replica_step, args=(data,))
            return reduce_per_replica(outputs, strategy, "auto")

        self._step = traced_as_keras(_compile(model, step))

    def __call__(self, data: Any) -> Dict[str, Any]:
        try:
            return self._step(data)
        except Exception:
            if not self._custom:
                began = int(self._started.read_value().numpy()) > 0
                self.last_outcome = StepOutcome.UPDATE_BEGAN if began else StepOutcome.RESTORED
            raise


class ReplicaAccumulator:
    """Sums each replica's weighted micro-batch gradients; applies them as one step.

    The sums are `ON_READ`/`SUM` variables (one copy per replica), made at the first micro-batch.
    `apply` calls `apply_gradients` once on every replica with its local sums, which the optimizer
    all-reduces: Keras's update on the whole batch. Sparse gradients are kept as each replica's
    rows, as on one device, unless the optimizer sums rows exactly (`sums_sparse_exactly`).
    """

    def __init__(self, model: keras.Model, strategy: tf.distribute.Strategy) -> None:
        self._model = weakref.ref(model)
        self._strategy = strategy
        self._weights = list(model.trainable_weights)
        self._sums: Optional[List[Any]] = None  # per weight; None: a sparse gradient kept as rows
        self._kept: List[List[List[Any]]] = []  # per kept gradient, per replica: (values, indices)
        self._held: Optional[str] = None
        self._traced = {"mask": tuple(False for _ in self._weights)}

    def _make(self, data: Any) -> None:
        """The sums (none for the sparse gradients kept as rows) and the compiled steps."""
        model, strategy, traced = self._model(), self._strategy, self._traced
        model_ref, weights = self._model, self._weights
        keeps_rows = not sums_sparse_exactly(model.optimizer)
        local = keras.tree.map_structure(lambda v: _local(strategy, v)[0], data)
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

        @tf.function
        def reset():
            for total in sums:
                if total is not None:
                    total.assign(tf.zeros_like(total))

        self._add = _compile(model, add, static_shapes=_needs_static_batch(model))
        self._apply = _compile(model, apply)
        self._reset = reset

    def reset(self) -> None:
        """Start a new batch: zero the sums on every replica, drop the kept rows."""
        self._kept = []
        if self._sums is not None:
            self._reset()

    def add(self, data: Any, weight: Any, loss_factor: Any) -> None:
        """Add each replica's `weight` times its gradient on its rows of `data`.

        Args:
            data: A distributed batch (`Replicas.distribute`).
            weight: A distributed float per replica (`Replicas.scalars`).
            loss_factor: Likewise, what each replica's loss tracker multiplies its loss by.
        """
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
        """Apply the summed gradients (and each replica's kept rows) as one optimizer step."""
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
