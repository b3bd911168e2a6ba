"""OOM detection (`is_oom_error` and its named predicates) and `OutOfMemoryError`."""

from __future__ import annotations

import copy
import pickle

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_memfit
from keras_memfit import OutOfMemoryError, is_oom_error
from keras_memfit import oom as oom_module
from support import BACKEND, oom_error, oom_error_class, requires_tensorflow, wrap_factory

XLA_MESSAGE = "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 12345 bytes."


# ---------------------------------------------------------------------------
# is_oom_error: true for every form
# ---------------------------------------------------------------------------
OOM_FORMS = {
    "tf ResourceExhaustedError": lambda: tf.errors.ResourceExhaustedError(
        None, None, "OOM when allocating tensor with shape[4096,4096] and type float"
    ),
    "tf ResourceExhaustedError, empty message": lambda: tf.errors.ResourceExhaustedError(
        None, None, ""
    ),
    "InternalError Dst tensor": lambda: tf.errors.InternalError(
        None, None, "Dst tensor is not initialized."
    ),
    "InternalError Dst tensor inside a longer message": lambda: tf.errors.InternalError(
        None, None,
        "Graph execution error:\n\nDetected at node 'sequential/dense/MatMul'\n"
        "Dst tensor is not initialized.\n\t [[{{node _send}}]]",
    ),
    "InternalError failed to allocate memory": lambda: tf.errors.InternalError(
        None, None, "failed to allocate memory"
    ),
    "InternalError Failed to allocate memory (capitalised)": lambda: tf.errors.InternalError(
        None, None, "Failed to allocate memory for the batch of component 0"
    ),
    "XLA inside UnknownError": lambda: tf.errors.UnknownError(None, None, XLA_MESSAGE),
    "XLA inside RuntimeError": lambda: RuntimeError(XLA_MESSAGE),
    "XLA inside InternalError": lambda: tf.errors.InternalError(None, None, XLA_MESSAGE),
    "XLA after a prefix, multi-line": lambda: RuntimeError(
        "Execution failed:\n" + XLA_MESSAGE + "\nBufferAssignment OOM Debugging."
    ),
    "CUBLAS in InternalError": lambda: tf.errors.InternalError(
        None, None, "Blas GEMM launch failed: CUBLAS_STATUS_ALLOC_FAILED"
    ),
    "CUBLAS in RuntimeError": lambda: RuntimeError(
        "cuBLAS call failed status = CUBLAS_STATUS_ALLOC_FAILED"
    ),
    "CUDNN in UnknownError": lambda: tf.errors.UnknownError(
        None, None, "Failed to get convolution algorithm: CUDNN_STATUS_ALLOC_FAILED"
    ),
    "CUDNN in RuntimeError": lambda: RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),
    "CUDA_ERROR_OUT_OF_MEMORY": lambda: tf.errors.InternalError(
        None, None, "CUDA_ERROR_OUT_OF_MEMORY: out of memory"
    ),
    "MemoryError": lambda: MemoryError(),
    "MemoryError with message": lambda: MemoryError("Unable to allocate 8.00 GiB for an array"),
    "MemoryError subclass": lambda: type("MyMemoryError", (MemoryError,), {})("host"),
}


# TensorFlow's own classes are OOMs only where Keras runs on TensorFlow (the
# backend's forms are the active backend's; XLA, CUDA and host forms are shared).
TENSORFLOW_ONLY_FORMS = {
    "tf ResourceExhaustedError", "tf ResourceExhaustedError, empty message",
    "InternalError Dst tensor", "InternalError Dst tensor inside a longer message",
    "InternalError failed to allocate memory",
    "InternalError Failed to allocate memory (capitalised)",
}


def _forms(forms, backend_only):
    return [
        pytest.param(make, id=name, marks=[requires_tensorflow] if name in backend_only else [])
        for name, make in forms.items()
    ]


@pytest.mark.parametrize("make", _forms(OOM_FORMS, TENSORFLOW_ONLY_FORMS))
def test_is_oom_error_true_for_every_form(make):
    exc = make()
    assert is_oom_error(exc) is True


def test_is_oom_error_true_for_a_raised_and_caught_error():
    # The same check on an error that went through a real raise (traceback set).
    with pytest.raises(oom_error_class()) as excinfo:
        raise oom_error()
    assert is_oom_error(excinfo.value) is True


# ---------------------------------------------------------------------------
# is_oom_error: false for everything else
# ---------------------------------------------------------------------------
NOT_OOM_FORMS = {
    "ValueError": lambda: ValueError("Input 0 of layer dense is incompatible"),
    "InvalidArgumentError": lambda: tf.errors.InvalidArgumentError(
        None, None, "Matrix size-incompatible: In[0]: [32,4], In[1]: [5,3]"
    ),
    "InternalError about something else": lambda: tf.errors.InternalError(
        None, None, "cuDNN launch failure : input shape ([1,3,32,32])"
    ),
    "UnknownError about something else": lambda: tf.errors.UnknownError(
        None, None, "JIT compilation failed."
    ),
    "KeyboardInterrupt": lambda: KeyboardInterrupt(),
    "SystemExit": lambda: SystemExit(1),
    "GeneratorExit": lambda: GeneratorExit(),
    "ValueError mentioning memory": lambda: ValueError(
        "memory layout of the array must be C-contiguous"
    ),
    "RuntimeError mentioning memory": lambda: RuntimeError(
        "shared memory segment /psm_123 not found"
    ),
    "InvalidArgumentError mentioning memory": lambda: tf.errors.InvalidArgumentError(
        None, None, "memory_limit must be positive; received -1"
    ),
    "InternalError mentioning memory": lambda: tf.errors.InternalError(
        None, None, "memory stats are not available on this device"
    ),
    "TypeError": lambda: TypeError("unsupported operand"),
    "plain Exception": lambda: Exception(),
}


@pytest.mark.parametrize("make", list(NOT_OOM_FORMS.values()), ids=list(NOT_OOM_FORMS))
def test_is_oom_error_false_for_everything_else(make):
    exc = make()
    assert is_oom_error(exc) is False


@pytest.mark.parametrize(
    "value",
    ["OOM", None, 42, ValueError, tf.errors.ResourceExhaustedError, MemoryError],
    ids=["str", "None", "int", "ValueError class", "ResourceExhaustedError class",
         "MemoryError class"],
)
def test_is_oom_error_rejects_non_exceptions(value):
    with pytest.raises(TypeError) as excinfo:
        is_oom_error(value)
    message = str(excinfo.value)
    assert "exception instance" in message
    assert type(value).__name__ in message


def test_is_oom_error_uses_str_when_message_attribute_is_not_a_string():
    class Odd(Exception):
        message = None

    assert is_oom_error(Odd("CUBLAS_STATUS_ALLOC_FAILED")) is True
    assert is_oom_error(Odd(XLA_MESSAGE)) is True
    assert is_oom_error(Odd("nothing to see")) is False


def test_is_oom_error_is_exported_at_top_level():
    assert keras_memfit.is_oom_error is is_oom_error
    assert keras_memfit.OutOfMemoryError is OutOfMemoryError


# ---------------------------------------------------------------------------
# The named predicates
# ---------------------------------------------------------------------------
def test_is_host_oom():
    assert oom_module.is_host_oom(MemoryError()) is True
    assert oom_module.is_host_oom(type("Sub", (MemoryError,), {})()) is True
    assert oom_module.is_host_oom(RuntimeError("out of memory")) is False
    assert oom_module.is_host_oom(
        tf.errors.ResourceExhaustedError(None, None, "OOM")
    ) is False


@pytest.mark.parametrize(
    "message, expected",
    [
        (XLA_MESSAGE, True),
        ("RESOURCE_EXHAUSTED: out of memory", True),
        ("RESOURCE_EXHAUSTED: Failed to allocate request for 1.00GiB (1073741824B) on device "
         "ordinal 0", True),
        ("prefix\nRESOURCE_EXHAUSTED:\nOut of memory while trying to allocate 8 bytes", True),
        ("Out of memory while trying to allocate 8 bytes", False),  # no status code
        ("CUBLAS_STATUS_ALLOC_FAILED", False),
        ("INVALID_ARGUMENT: shape mismatch", False),
        ("", False),
    ],
)
def test_is_xla_oom(message, expected):
    assert oom_module.is_xla_oom(RuntimeError(message)) is expected


@pytest.mark.parametrize(
    "message, expected",
    [
        ("CUBLAS_STATUS_ALLOC_FAILED", True),
        ("failed to create cublas handle: CUBLAS_STATUS_ALLOC_FAILED", True),
        ("Could not create cudnn handle: CUDNN_STATUS_ALLOC_FAILED", True),
        ("CUDA_ERROR_OUT_OF_MEMORY: out of memory", True),
        ("cudaErrorMemoryAllocation", True),
        ("CUDA error: out of memory", True),
        ("CUBLAS_STATUS_EXECUTION_FAILED", False),
        ("CUDNN_STATUS_BAD_PARAM", False),
        ("Could not allocate memory for the embedding table", False),
        (XLA_MESSAGE, False),
    ],
)
def test_is_cuda_alloc_failure(message, expected):
    assert oom_module.is_cuda_alloc_failure(RuntimeError(message)) is expected


@requires_tensorflow
def test_backend_predicate_covers_tensorflow_forms_only():
    from keras_memfit.backend import tensorflow as tf_backend

    assert tf_backend.is_oom_error(tf.errors.ResourceExhaustedError(None, None, "x")) is True
    assert tf_backend.is_oom_error(
        tf.errors.InternalError(None, None, "Dst tensor is not initialized.")
    ) is True
    assert tf_backend.is_oom_error(
        tf.errors.InternalError(None, None, "failed to allocate memory")
    ) is True
    assert tf_backend.is_oom_error(tf.errors.InternalError(None, None, "other")) is False
    assert tf_backend.is_oom_error(RuntimeError("Dst tensor is not initialized.")) is False
    assert tf_backend.is_oom_error(MemoryError()) is False


# ---------------------------------------------------------------------------
# OutOfMemoryError
# ---------------------------------------------------------------------------
def make_error(**overrides):
    kwargs = dict(
        model_name="my_classifier",
        phase="predict",
        batch_shape=[(1, 28, 28, 3), (1, 7)],
        device="GPU:0",
    )
    kwargs.update(overrides)
    return OutOfMemoryError(**kwargs)


def test_out_of_memory_error_is_catchable_as_itself():
    with pytest.raises(OutOfMemoryError) as excinfo:
        raise make_error()
    assert excinfo.value.phase == "predict"


@requires_tensorflow
def test_out_of_memory_error_is_catchable_as_resource_exhausted_error():
    caught = None
    try:
        raise make_error()
    except tf.errors.ResourceExhaustedError as err:  # existing user code
        caught = err
    assert isinstance(caught, OutOfMemoryError)
    assert isinstance(caught, tf.errors.OpError)
    assert caught.error_code == tf.errors.RESOURCE_EXHAUSTED


def test_out_of_memory_error_is_catchable_as_the_backends_oom_error():
    caught = None
    try:
        raise make_error()
    except oom_error_class() as err:  # existing user code: tf's or jax's error class
        caught = err
    assert isinstance(caught, OutOfMemoryError)


def test_out_of_memory_error_is_itself_an_oom():
    assert is_oom_error(make_error()) is True


def test_out_of_memory_error_message_names_everything():
    err = make_error()
    message = str(err)
    assert "my_classifier" in message
    assert "predict" in message
    assert "(1, 28, 28, 3)" in message
    assert "(1, 7)" in message
    assert "GPU:0" in message
    assert "single sample" in message
    assert "mixed precision" in message
    assert "mixed_float16" in message
    if BACKEND == "tensorflow":
        assert err.message == message  # tf's OpError.message agrees with str()


def test_out_of_memory_error_message_for_other_phase_and_unknown_device():
    err = make_error(phase="evaluate", device=None, batch_shape=())
    message = str(err)
    assert "in evaluate" in message
    assert " on " not in message.split("even with")[0]
    assert "unknown" in message


def test_out_of_memory_error_detail_is_in_message():
    err = make_error(detail="The first Dense layer holds 3.2 GiB.")
    assert "The first Dense layer holds 3.2 GiB." in str(err)


def test_out_of_memory_error_attributes():
    err = make_error()
    assert err.model_name == "my_classifier"
    assert err.phase == "predict"
    assert err.batch_shape == ((1, 28, 28, 3), (1, 7))
    assert isinstance(err.batch_shape, tuple)
    assert err.device == "GPU:0"


@pytest.mark.parametrize("roundtrip", [
    lambda e: pickle.loads(pickle.dumps(e)),
    lambda e: pickle.loads(pickle.dumps(e, protocol=2)),
    copy.copy,
    copy.deepcopy,
], ids=["pickle", "pickle-protocol-2", "copy", "deepcopy"])
def test_out_of_memory_error_round_trips(roundtrip):
    err = make_error()
    back = roundtrip(err)
    assert type(back) is OutOfMemoryError
    assert isinstance(back, oom_error_class())
    assert back.model_name == err.model_name
    assert back.phase == err.phase
    assert back.batch_shape == err.batch_shape
    assert back.device == err.device
    assert str(back) == str(err)
    if BACKEND == "tensorflow":
        assert back.error_code == err.error_code


def test_out_of_memory_error_with_detail_round_trips_through_pickle():
    err = make_error(detail="The first Dense layer holds 3.2 GiB.")
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == str(err)


# ---------------------------------------------------------------------------
# OutOfMemoryError as raised by safe_predict
# ---------------------------------------------------------------------------
@pytest.fixture
def always_oom_step(monkeypatch):
    """Every compiled predict step raises the same (backend's) OOM error object."""
    original = oom_error("1 (always)")
    attempts = []

    def always_oom(real):
        def step(x):
            attempts.append(int(x.shape[0]))
            raise original

        return step

    wrap_factory(monkeypatch, "make_predict_step", always_oom)
    return original, attempts


def test_safe_predict_raises_out_of_memory_error_chained_to_the_original(always_oom_step):
    original, attempts = always_oom_step
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)], name="tiny_net")
    x = np.ones((40, 4), "float32")
    with pytest.raises(OutOfMemoryError) as excinfo:
        keras_memfit.safe_predict(model, x, batch_size=8, verbose=0)
    err = excinfo.value
    assert err.__cause__ is original
    assert err.model_name == "tiny_net"
    assert err.phase == "predict"
    assert err.batch_shape == ((1, 4),)
    device = {"jax": "cpu:0", "torch": "cpu:0"}.get(BACKEND, "CPU:0")  # as the backend names it
    assert err.device == device
    assert "tiny_net" in str(err) and "(1, 4)" in str(err) and device in str(err)
    # It shrank down to a single sample before giving up (halving where memory
    # is known, faster where nothing is: shape_plan.blind_size).
    assert attempts[0] == 8 and attempts[-1] == 1
    assert attempts == sorted(set(attempts), reverse=True)


def test_safe_predict_out_of_memory_error_caught_as_resource_exhausted(always_oom_step):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    x = np.ones((5, 4), "float32")
    with pytest.raises(oom_error_class()) as excinfo:
        keras_memfit.safe_predict(model, x, batch_size=2, verbose=0)
    assert isinstance(excinfo.value, OutOfMemoryError)
    assert excinfo.value.__cause__ is always_oom_step[0]
