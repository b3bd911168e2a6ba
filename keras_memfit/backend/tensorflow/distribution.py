"""The seam's `Distribution` on TensorFlow: `tf.distribute` strategies, in one process.

Multi-worker strategies are refused (`distribute`), so nothing here agrees with other processes.
"""

from __future__ import annotations

from keras_memfit.backend.tensorflow import distribute, replicas

distribution_of = replicas.distribution_of
replica_devices = replicas.replica_devices
training_replicas = distribute.training_replicas


def piece_multiple() -> int:
    """1: any piece size runs (tf.distribute splits uneven batches itself)."""
    return 1

