"""TensorFlow implementation of the backend seam (see `keras_memfit.backend.base`).

One module per concern; the first seven are the modules every backend
package has. This module exports the names of the `Backend` protocol.

- `oom`: TensorFlow's OOM forms, the bases of `OutOfMemoryError`;
- `memory`: memory statistics and limits of TensorFlow's devices;
- `steps`: compiled predict and test steps, their traced outputs, guards;
- `training`: train steps that say how far a failed call got (under XLA
  split as JAX's are);
- `trainer`: Keras's step functions in TensorFlow's calling convention;
- `devices`: naming devices, moving variables, pinning calls (`place`);
- `tracing`: the model's layer calls, traced symbolically;
- `replicas`: the inference steps on every replica of a
  `tf.distribute.MirroredStrategy` (used by `steps` and `memory`);
- `distribute`: MemFit's train, test and predict steps under a
  `tf.distribute` strategy;
- `accumulation`: gradient accumulation on one device;
- `holds`: what a compiled step that updates variables holds while it runs
  under XLA.
"""

from __future__ import annotations

from keras_memfit.backend.tensorflow.devices import (
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
from keras_memfit.backend.tensorflow.distribute import (
    Replicas,
    combine_process_metrics,
    process_count,
    process_failed,
    training_replicas,
)
from keras_memfit.backend.tensorflow.replicas import distribution_of
from keras_memfit.backend.tensorflow.memory import (
    compiles_per_shape,
    compute_device,
    memory_limit,
    memory_stats,
    piece_multiple,
    replica_devices,
    reset_peak,
)
from keras_memfit.backend.tensorflow.oom import init_oom_error, is_oom_error, oom_error_bases
from keras_memfit.backend.tensorflow.steps import (
    KERAS_COUNTS_EACH_BATCH_ONCE,
    VariableGuard,
    guard_variables,
    make_predict_step,
    make_test_step,
    output_spec,
    prepare_test,
)
from keras_memfit.backend.tensorflow.tracing import trace_layer_calls
from keras_memfit.backend.tensorflow.trainer import (
    adapter_batches,
    call_keras_function,
    is_end_of_data,
    materialize,
    step_function,
)
from keras_memfit.backend.tensorflow.accumulation import GradientAccumulator, make_accumulator
from keras_memfit.backend.tensorflow.training import (
    CustomTrainStep,
    TrainStep,
    has_default_train_step,
    make_custom_train_step,
    make_train_step,
)

__all__ = [
    # oom
    "init_oom_error", "is_oom_error", "oom_error_bases",
    # distribute (MemFit under tf.distribute.MirroredStrategy)
    "Replicas", "combine_process_metrics", "process_count", "process_failed",
    "training_replicas",
    # memory
    "compiles_per_shape", "compute_device", "memory_limit", "memory_stats", "piece_multiple", "replica_devices",
    "reset_peak",
    # steps
    "KERAS_COUNTS_EACH_BATCH_ONCE", "VariableGuard", "guard_variables", "make_predict_step",
    "make_test_step",
    "output_spec", "prepare_test",
    # training
    "CustomTrainStep", "GradientAccumulator", "TrainStep", "has_default_train_step",
    "make_accumulator", "make_custom_train_step", "make_train_step", "distribution_of",
    # trainer
    "adapter_batches", "call_keras_function", "is_end_of_data", "materialize", "step_function",
    # devices
    "PLACES_LAYERS", "call_on_device", "canonical_device", "creating_on", "device_exists", "device_scope",
    "follow_variable_devices", "host_device", "list_accelerators", "move_variable",
    "variable_device",
    # tracing
    "trace_layer_calls",
]
