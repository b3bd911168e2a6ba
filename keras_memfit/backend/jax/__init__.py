"""JAX implementation of the backend seam (`keras_memfit.backend.base`).

- `oom`: JAX's OOM forms, the bases of `OutOfMemoryError`;
- `memory`: memory statistics and limits of JAX's devices;
- `steps`: compiled predict and test steps, also started without waiting;
- `training`: train steps that never lose the model's state to an OOM;
- `keras_functions`: Keras's step functions in JAX's calling convention;
- `devices`: naming devices;
- `tracing`: the model's layer calls, traced with `jax.eval_shape`;
- `distribution`: `DataParallel`'s pieces laid out over the devices; the steps' variant;
- `accumulation`: gradient accumulation's programs and accumulator;
- `state`: Keras's JAX state tuple threaded through MemFit's steps;
- `processes`: several JAX processes: their agreement, local copies, sums;
- `process_training`: MemFit's train step and accumulator under several processes.
"""

from keras_memfit.backend.jax.oom import (
    init_oom_error, is_oom_error, oom_error_bases,
)
from keras_memfit.backend.jax.memory import (
    compiles_per_shape, compute_device, conv_columns, memory_limit, memory_stats, reset_peak,
)
from keras_memfit.backend.jax.steps import (
    KERAS_BEGINS_BATCH_BEFORE_FETCH, KERAS_COUNTS_EACH_BATCH_ONCE, guard_variables,
    make_predict_step, make_test_step, output_spec, prepare_test,
)
from keras_memfit.backend.jax.training import (
    check_training_mode, checkpoint, make_accumulator, make_custom_train_step,
    make_train_step,
)
from keras_memfit.backend.jax.keras_functions import (
    adapter_batches, call_keras_function, is_end_of_data, materialize, keras_call,
)
from keras_memfit.backend.jax.devices import (
    canonical_device, device_exists, host_device, list_accelerators, variable_device,
)
from keras_memfit.backend.jax.tracing import trace_layer_calls
from keras_memfit.backend.jax.distribution import (
    distribution_of, evaluation, piece_multiple, replica_devices, step_variant,
    training_layout,
)

placement = None  # `place` cannot keep layers on another device here
