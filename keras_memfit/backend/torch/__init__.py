"""PyTorch implementation of the backend seam (see `keras_memfit.backend.base`).

One module per concern, the seven every backend package has. This module
exports the names of the `Backend` protocol.

- `oom`: PyTorch's OOM forms, the bases of `OutOfMemoryError`;
- `memory`: CUDA's caching allocator (nothing on the CPU);
- `steps`: predict and test steps under `torch.no_grad()`, guards;
- `training`: train steps that say how far a failed call got, and gradient
  accumulation;
- `trainer`: Keras's step functions in torch's calling convention;
- `devices`: naming devices (`place` is not implemented);
- `tracing`: the model's layer calls, traced on the "meta" device.

Keras's torch trainer runs its steps eagerly and updates the weights in
place; nothing is donated, so an OOM in a forward or backward pass leaves the
model's weights as they were. What a failed step may already have changed
(the loss tracker, metrics, BatchNorm statistics, RNG seeds) is snapshotted
and restored (`steps.VariableGuard`, `training.TrainStep`); the train step
knows whether its optimizer update had begun. After an OOM the next step
returns PyTorch's cached CUDA blocks first (`torch.cuda.empty_cache()`).
Memory statistics come from CUDA's caching allocator; the CPU has none (the
planner learns from the first OOM). `memory_report` traces the model on the
"meta" device (`tracing`). Not implemented: `place` (`devices`) raises
`NotImplementedError`; `torch.distributed` is refused (`training`). Models
compiled with `jit_compile=True` run keras_memfit's steps eagerly (no
`torch.compile`).
"""

from __future__ import annotations

from keras_memfit.backend.torch.devices import (
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
from keras_memfit.backend.torch.memory import (
    compiles_per_shape,
    compute_device,
    memory_limit,
    memory_stats,
    piece_multiple,
    replica_devices,
    reset_peak,
)
from keras_memfit.backend.torch.oom import init_oom_error, is_oom_error, oom_error_bases
from keras_memfit.backend.torch.steps import (
    KERAS_BEGINS_BATCH_BEFORE_FETCH,
    KERAS_COUNTS_EACH_BATCH_ONCE,
    VariableGuard,
    guard_variables,
    make_predict_step,
    make_test_step,
    output_spec,
    prepare_test,
)
from keras_memfit.backend.torch.tracing import trace_layer_calls
from keras_memfit.backend.torch.trainer import (
    adapter_batches,
    call_keras_function,
    is_end_of_data,
    materialize,
    step_function,
)
from keras_memfit.backend.torch.training import (
    CustomTrainStep,
    GradientAccumulator,
    TrainStep,
    has_default_train_step,
    make_accumulator,
    make_custom_train_step,
    make_train_step,
    training_replicas,
    distribution_of,
    process_count,
    combine_process_metrics,
    process_failed,
)

__all__ = [
    # oom
    "init_oom_error", "is_oom_error", "oom_error_bases",
    # memory
    "compiles_per_shape", "compute_device", "memory_limit", "memory_stats", "piece_multiple",
    "replica_devices", "reset_peak",
    # steps
    "KERAS_BEGINS_BATCH_BEFORE_FETCH", "KERAS_COUNTS_EACH_BATCH_ONCE", "VariableGuard", "guard_variables", "make_predict_step",
    "make_test_step", "output_spec", "prepare_test",
    # training
    "CustomTrainStep", "GradientAccumulator", "TrainStep", "has_default_train_step",
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
