"""A GPU's memory limit nobody set: read from NVML, or learned from one OOM.

NVML (`nvidia-ml-py`, a dependency): no GPU here, so a fake `pynvml`
module (in `sys.modules`) answers instead and records what it is asked,
and TensorFlow's device queries are monkeypatched to show a GPU. This checks
which device NVML is asked about, what is asked, and the arithmetic against
TensorFlow's own rule (gpu_device.cc: the free memory less
`MinSystemMemory`); that the numbers match a real GPU's allocator is
unverified here.

Unknown limit: under the capped CPU allocator with `memory_limit` forced to
return None (the cap is real, the planner does not know it), the first
`safe_predict` of a batch far too large pays one real OOM and the second
none, against `model.predict` at a batch that fits.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import types

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import keras_memfit  # noqa: E402
from keras_memfit.backend.tensorflow import memory  # noqa: E402

MiB = 1 << 20
T4_TOTAL = 15360 * MiB  # what NVML reports for a 16 GB T4


# ----------------------------------------------------------------- fakes
class FakeProcess:
    def __init__(self, pid, used):
        self.pid = pid
        self.usedGpuMemory = used


class FakeNVMLError(Exception):
    pass


def fake_pynvml(*, total=T4_TOTAL, name="Tesla T4", cc=(7, 5), processes=(),
                init_error=False):
    """A stand-in `pynvml` module; `module.calls` lists what was asked, in order."""
    module = types.ModuleType("pynvml")
    module.calls = []
    module.NVMLError = FakeNVMLError

    def record(fn_name, result):
        def fn(*args):
            module.calls.append((fn_name, *args))
            if isinstance(result, Exception):
                raise result
            return result(*args) if callable(result) else result
        return fn

    module.nvmlInit = record("nvmlInit", FakeNVMLError("NVML Shared Library Not Found")
                             if init_error else None)
    module.nvmlDeviceGetHandleByIndex = record("byIndex", lambda i: ("handle", i))
    module.nvmlDeviceGetHandleByUUID = record("byUUID", lambda u: ("handle", u))
    module.nvmlDeviceGetName = record("name", name)
    module.nvmlDeviceGetMemoryInfo = record(
        "memory", types.SimpleNamespace(total=total, free=0, used=total))
    module.nvmlDeviceGetCudaComputeCapability = record("cc", cc)
    module.nvmlDeviceGetComputeRunningProcesses = record("processes", list(processes))
    return module


class Untouchable(types.ModuleType):
    """A `pynvml` that fails the test if anything is looked up on it."""

    def __getattr__(self, name):
        raise AssertionError(f"pynvml.{name} was used")


@pytest.fixture
def gpu(monkeypatch):
    """Make TensorFlow show GPUs (`gpu(n, logical_limit_mb=None, name=...)`)."""
    monkeypatch.setattr(memory, "_nvml_ready", None)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("TF_DEVICE_MIN_SYS_MEMORY_IN_MB", raising=False)

    def make(n=1, logical_limit_mb=None, name="Tesla T4"):
        devices = [tf.config.PhysicalDevice(f"/physical_device:GPU:{i}", "GPU")
                   for i in range(n)]
        real_list = tf.config.list_physical_devices

        def list_physical(kind=None):
            return list(devices) if kind == "GPU" else real_list(kind)

        def logical_config(device):
            assert device in devices
            if logical_limit_mb is None:
                return []
            return [tf.config.LogicalDeviceConfiguration(memory_limit=logical_limit_mb)]

        def details(device):
            assert device in devices
            return {"device_name": name, "compute_capability": (7, 5)}

        real_visible = tf.config.get_visible_devices

        def visible(kind=None):
            return list(devices) if kind == "GPU" else real_visible(kind)

        monkeypatch.setattr(tf.config, "list_physical_devices", list_physical)
        monkeypatch.setattr(tf.config, "get_visible_devices", visible)
        monkeypatch.setattr(tf.config, "get_logical_device_configuration", logical_config)
        monkeypatch.setattr(tf.config.experimental, "get_device_details", details)
        return devices

    return make


def install(monkeypatch, module):
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return module


# ------------------------------------------------------- NVML, faked GPU
def test_whole_gpu_limit_from_nvml_as_tensorflow_sizes_its_allocator(gpu, monkeypatch):
    gpu(1)
    me, other = os.getpid(), os.getpid() + 1
    nvml = install(monkeypatch, fake_pynvml(processes=[
        FakeProcess(me, 14000 * MiB), FakeProcess(other, 1000 * MiB)]))

    limit = memory.memory_limit("GPU:0")

    # TensorFlow's allocator gets the free memory when it starts (total, less
    # the other process, less its own CUDA context, taken as 512 MiB) less
    # MinSystemMemory, 1050 MiB for compute capability 7.x.
    assert limit == ((15360 - 1000 - 512 - 1050) * MiB, True)
    assert nvml.calls == [
        ("nvmlInit",), ("byIndex", 0), ("name", ("handle", 0)),
        ("memory", ("handle", 0)), ("cc", ("handle", 0)), ("processes", ("handle", 0)),
    ]
    # NVML is initialised once per process.
    nvml.calls.clear()
    assert memory.memory_limit("GPU:0") == limit
    assert ("nvmlInit",) not in nvml.calls


@pytest.mark.parametrize("cc, reserve_mib", [((6, 0), 500), ((7, 5), 1050),
                                              ((8, 0), 1536), ((9, 0), 1800)])
def test_reserve_follows_tensorflow_by_compute_capability(gpu, monkeypatch, cc, reserve_mib):
    gpu(1)
    install(monkeypatch, fake_pynvml(total=16384 * MiB, cc=cc,
                                     processes=[FakeProcess(os.getpid(), 1)]))
    assert memory.memory_limit("GPU:0") == ((16384 - 512 - reserve_mib) * MiB, True)


def test_reserve_set_by_tf_device_min_sys_memory_in_mb(gpu, monkeypatch):
    gpu(1)
    monkeypatch.setenv("TF_DEVICE_MIN_SYS_MEMORY_IN_MB", "300")
    install(monkeypatch, fake_pynvml())
    assert memory.memory_limit("GPU:0") == ((15360 - 512 - 300) * MiB, True)
    assert memory.min_system_memory(1 << 40, 9) == 300 * MiB


def test_small_gpu_keeps_225_mib():
    assert memory.min_system_memory((2 << 30) - 1, 8) == 225 * MiB


@pytest.mark.parametrize("visible, device, asked", [
    ("2,3", "GPU:1", ("byIndex", 3)),
    ("GPU-8a1f", "GPU:0", ("byUUID", "GPU-8a1f")),
])
def test_cuda_visible_devices_maps_tensorflows_gpu_to_nvmls(gpu, monkeypatch, visible,
                                                             device, asked):
    gpu(2 if device == "GPU:1" else 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    nvml = install(monkeypatch, fake_pynvml())
    assert memory.memory_limit(device) == ((15360 - 512 - 1050) * MiB, True)
    assert nvml.calls[1] == asked


def test_mig_slice_is_unknown_without_asking_nvml(gpu, monkeypatch):
    gpu(1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-4b1c")
    nvml = install(monkeypatch, fake_pynvml())
    assert memory.memory_limit("GPU:0") is None
    assert nvml.calls == []


def test_a_gpu_nvml_names_differently_is_unknown(gpu, monkeypatch):
    gpu(1, name="Tesla P100-PCIE-16GB")
    install(monkeypatch, fake_pynvml(name=b"Tesla T4"))
    assert memory.memory_limit("GPU:0") is None


def test_logical_device_limit_wins_and_nvml_is_not_used(gpu, monkeypatch):
    gpu(1, logical_limit_mb=1024)
    install(monkeypatch, Untouchable("pynvml"))
    assert memory.memory_limit("GPU:0") == (1024 * MiB, True)


@pytest.mark.parametrize("processes, expected", [
    # A container may list host process ids: one process is this one...
    ([FakeProcess(1, 14000 * MiB)], (15360 - 512 - 1050) * MiB),
    # ...but with several, which is this one cannot be told.
    ([FakeProcess(1, 14000 * MiB), FakeProcess(2, 300 * MiB)], None),
    # An other process whose usage NVML does not report.
    ([FakeProcess(os.getpid(), 1), FakeProcess(2, None)], None),
])
def test_other_processes(gpu, monkeypatch, processes, expected):
    gpu(1)
    install(monkeypatch, fake_pynvml(processes=processes))
    limit = memory.memory_limit("GPU:0")
    assert limit == (None if expected is None else (expected, True))


def test_nvml_failing_to_start_is_unknown_and_not_retried(gpu, monkeypatch):
    gpu(1)
    nvml = install(monkeypatch, fake_pynvml(init_error=True))
    assert memory.memory_limit("GPU:0") is None
    assert memory.memory_limit("GPU:0") is None
    assert nvml.calls == [("nvmlInit",)]


def test_without_nvidia_ml_py_the_limit_is_unknown(gpu, monkeypatch):
    gpu(1)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import raises ImportError
    assert memory.memory_limit("GPU:0") is None


def test_no_gpu_never_touches_nvml(monkeypatch):
    # This machine's real TensorFlow, which sees no GPU.
    if tf.config.list_physical_devices("GPU"):
        pytest.skip("a GPU is visible here")
    monkeypatch.setattr(memory, "_nvml_ready", None)
    install(monkeypatch, Untouchable("pynvml"))
    assert memory.memory_limit("GPU:0") is None
    assert memory.compute_device() == "CPU:0"


def test_real_nvidia_ml_py_without_a_driver_is_unknown(monkeypatch, gpu):
    pynvml = pytest.importorskip("pynvml")
    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("an NVIDIA driver is present")
    gpu(1)
    monkeypatch.setitem(sys.modules, "pynvml", pynvml)
    assert memory.memory_limit("GPU:0") is None


# ------------------------------------------- unknown limit, real OOMs
CAP_MB = 200  # about 500 samples of the CNN below fit at predict time
OOM_RE = re.compile(r"out of memory at batch_size=(\d+)")


def _ooms(caplog):
    return [int(m.group(1)) for r in caplog.records if r.name == "keras_memfit"
            for m in [OOM_RE.search(r.getMessage())] if m]


@pytest.mark.memory_cap(CAP_MB)
def test_unknown_limit_first_call_pays_one_oom_and_the_second_none(caplog, monkeypatch):
    """The cap is real, the planner does not know it (a GPU NVML cannot read)."""
    from keras_memfit.backend import tensorflow as tf_backend

    monkeypatch.setattr(tf_backend, "memory_limit", lambda device: None)
    caplog.set_level(logging.INFO, logger="keras_memfit")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((28, 28, 1))
    h = keras.layers.Conv2D(32, 3, activation="relu")(inputs)
    h = keras.layers.Conv2D(64, 3, activation="relu")(h)
    h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Flatten()(h)
    model = keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(h))
    x = np.random.default_rng(0).random((28000, 28, 28, 1), dtype=np.float32)
    reference = model.predict(x, batch_size=128, verbose=0)

    first = keras_memfit.safe_predict(model, x, batch_size=28000, verbose=0)
    # One real attempt at the whole batch (no probes first: the limit is
    # unknown) fails; nothing after it does.
    assert _ooms(caplog) == [28000], caplog.text[-3000:]
    np.testing.assert_allclose(first, reference, rtol=1e-5, atol=1e-6)

    caplog.clear()
    second = keras_memfit.safe_predict(model, x, batch_size=28000, verbose=0)
    assert _ooms(caplog) == [], caplog.text[-3000:]
    np.testing.assert_allclose(second, reference, rtol=1e-5, atol=1e-6)
