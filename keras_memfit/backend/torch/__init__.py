"""PyTorch implementation of the backend seam (`keras_memfit.backend.base`).

Steps run eagerly and update weights in place, so an OOM leaves them intact.

- `oom`: PyTorch's OOM forms;
- `memory`: CUDA's caching allocator;
- `steps`: predict and test steps under `torch.no_grad()`, guards;
- `training`: train steps that say how far a failed call got, accumulation;
- `keras_functions`: Keras's step functions in torch's calling convention;
- `devices`: naming devices;
- `tracing`: the model's layer calls, traced on the "meta" device;
- `distribution`: one process on one device (`torch.distributed` refused).
"""

from keras_memfit.backend.base import check_training_mode, evaluation, materialize
from keras_memfit.backend.torch.oom import (
    init_oom_error, is_oom_error, oom_error_bases,
)
from keras_memfit.backend.torch.memory import (
    compiles_per_shape, compute_device, conv_columns, memory_limit, memory_stats, reset_peak,
)
from keras_memfit.backend.torch.steps import (
    KERAS_BEGINS_BATCH_BEFORE_FETCH, KERAS_COUNTS_EACH_BATCH_ONCE, guard_variables,
    make_predict_step, make_test_step, output_spec, prepare_test,
)
from keras_memfit.backend.torch.training import (
    checkpoint, make_accumulator, make_custom_train_step,
    make_train_step,
)
from keras_memfit.backend.torch.keras_functions import (
    adapter_batches, call_keras_function, is_end_of_data, keras_call,
)
from keras_memfit.backend.torch.devices import (
    canonical_device, device_exists, host_device, list_accelerators, variable_device,
)
from keras_memfit.backend.torch.tracing import trace_layer_calls
from keras_memfit.backend.torch.distribution import (
    distribution_of, piece_multiple, replica_devices, step_variant, training_layout,
)

placement = None  # `place` cannot keep layers on another device here
