"""TensorFlow implementation of the backend seam (`keras_memfit.backend.base`).

- `oom`: TensorFlow's OOM forms;
- `memory`: device memory statistics and limits;
- `steps`: compiled predict and test steps and their outputs;
- `training`: train steps that say how far a failed call got;
- `keras_functions`: Keras's step functions in TensorFlow's calling convention;
- `devices`: naming devices;
- `placement`: keeping layers on another device (`place`);
- `tracing`: the model's layer calls, traced symbolically;
- `distribution`: `tf.distribute` strategies: replicated steps, MemFit's layout, the guard;
- `compiling`: compiling and tracing steps as Keras does;
- `accumulation`: gradient accumulation on one device;
- `default_step`: Keras's default train step, in parts;
- `xla_holds`: what a compiled variable-updating step holds under XLA.
"""

from keras_memfit.backend.base import check_training_mode, evaluation, materialize
from keras_memfit.backend.tensorflow.oom import (
    init_oom_error, is_oom_error, oom_error_bases,
)
from keras_memfit.backend.tensorflow.memory import (
    compiles_per_shape, compute_device, conv_columns, memory_limit, memory_stats, reset_peak,
)
from keras_memfit.backend.tensorflow.steps import (
    KERAS_BEGINS_BATCH_BEFORE_FETCH, KERAS_COUNTS_EACH_BATCH_ONCE, guard_variables,
    make_predict_step, make_test_step, output_spec, prepare_test,
)
from keras_memfit.backend.tensorflow.training import (
    checkpoint, make_accumulator, make_custom_train_step,
    make_train_step,
)
from keras_memfit.backend.tensorflow.keras_functions import (
    adapter_batches, call_keras_function, is_end_of_data, keras_call,
)
from keras_memfit.backend.tensorflow.devices import (
    canonical_device, device_exists, host_device, list_accelerators, variable_device,
)
from keras_memfit.backend.tensorflow.tracing import trace_layer_calls
from keras_memfit.backend.tensorflow.distribution import (
    distribution_of, piece_multiple, replica_devices, step_variant, training_layout,
)
from keras_memfit.backend.tensorflow import placement
