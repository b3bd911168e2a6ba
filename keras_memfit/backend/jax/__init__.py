"""JAX implementation of the backend seam (see `keras_memfit.backend.base`).

One module per concern; the first seven are the modules every backend
package has. This module exports the names of the `Backend` protocol.

- `oom`: JAX's OOM forms, the bases of `OutOfMemoryError`;
- `memory`: memory statistics and limits of JAX's devices (the address-space
  limit on the CPU);
- `steps`: compiled predict and test steps, also started without waiting;
- `training`: train steps that never lose the model's state to an OOM, and
  gradient accumulation;
- `trainer`: Keras's step functions in JAX's calling convention;
- `devices`: naming devices (`place` is not implemented);
- `tracing`: the model's layer calls, traced with `jax.eval_shape`;
- `state`: Keras's JAX state tuple threaded through MemFit's steps;
- `distribution`: `keras.distribution.DataParallel`: pieces laid out over
  the devices;
- `processes`: several JAX processes: their agreement, local copies, sums;
- `process_training`: MemFit's train step and accumulator under several
  processes.

Keras's JAX trainer donates the model's state to its compiled steps, so an
out-of-memory error loses the model. Here what can run out of memory donates
nothing and writes the new state only once it succeeded (see `steps`); the
train step's optimizer update, which needs no memory that grows with the
batch, runs as a second program that updates the state in place
(`training.TrainStep`). Inside Keras's loops the steps work on Keras's own
state tuple (see `state`).
`memory_report` traces the model with `jax.eval_shape` (`tracing`). Not
implemented yet: `place` (`devices`) raises `NotImplementedError`.
"""

from __future__ import annotations

from keras_memfit.backend.jax.devices import (
    PLACES_LAYERS,
    call_on_device,
    canonical_device,
    creating_on,
    device_exists,
    device_scope,
    follow_variable_devices,
    host_device,
    list_accelerators,
    move_variable,
    variable_device,
)
from keras_memfit.backend.jax.distribution import distribution_of, piece_multiple, training_replicas
from keras_memfit.backend.jax.memory import (
    compiles_per_shape,
    compute_device,
    memory_limit,
    memory_stats,
    replica_devices,
    reset_peak,
)
from keras_memfit.backend.jax.oom import init_oom_error, is_oom_error, oom_error_bases
from keras_memfit.backend.jax.steps import (
    KERAS_COUNTS_EACH_BATCH_ONCE,
    VariableGuard,
    guard_variables,
    make_predict_step,
    make_test_step,
    output_spec,
    prepare_test,
)
from keras_memfit.backend.jax.tracing import trace_layer_calls
from keras_memfit.backend.jax.trainer import (
    adapter_batches,
    call_keras_function,
    is_end_of_data,
    materialize,
    step_function,
)
from keras_memfit.backend.jax.process_training import (
    make_accumulator,
    make_custom_train_step,
    make_train_step,
)
from keras_memfit.backend.jax.process_training import combine_process_metrics
from keras_memfit.backend.jax.processes import process_count, process_failed
from keras_memfit.backend.jax.training import (
    GradientAccumulator,
    TrainStep,
    has_default_train_step,
)

__all__ = [
    # oom
    "init_oom_error", "is_oom_error", "oom_error_bases",
    # memory
    "compiles_per_shape", "compute_device", "memory_limit", "memory_stats", "piece_multiple", "replica_devices",
    "reset_peak",
    # steps
    "KERAS_COUNTS_EACH_BATCH_ONCE", "VariableGuard", "guard_variables", "make_predict_step",
    "make_test_step",
    "output_spec", "prepare_test",
    # training
    "GradientAccumulator", "TrainStep", "has_default_train_step",
    "make_accumulator", "make_custom_train_step", "make_train_step", "training_replicas",
    "distribution_of", "process_count", "combine_process_metrics",
    "process_failed",
    # trainer
    "adapter_batches", "call_keras_function", "is_end_of_data", "materialize", "step_function",
    # devices
    "PLACES_LAYERS", "call_on_device", "canonical_device", "creating_on", "device_exists", "device_scope",
    "follow_variable_devices", "host_device", "list_accelerators", "move_variable",
    "variable_device",
    # tracing
    "trace_layer_calls",
]
