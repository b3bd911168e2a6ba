"""Shared test harness: real OOMs under a capped allocator, and fault injection.

The suite runs on Keras's active backend (`KERAS_BACKEND`: tensorflow, jax
or torch). Tests that exercise TensorFlow itself carry `@pytest.mark.tensorflow`
(a reason may be given); they, and the `memory_cap`, `two_devices` and `gpu`
tests (TensorFlow's allocator and devices), are skipped with that reason on
another backend. JAX's real OOMs are tests/test_jax_real_oom.py's, torch's
tests/test_torch_real_oom.py's. `@pytest.mark.not_on_torch(reason=...)`
skips what Keras's torch backend cannot do (steps_per_execution > 1).

Real OOMs
    `@pytest.mark.memory_cap(mb)` runs the test in a fresh subprocess whose
    CPU device sits behind TensorFlow's BFC allocator capped at `mb` MiB
    (`TF_CPU_ALLOCATOR_USE_BFC=true`, `TF_CPU_BFC_MEM_LIMIT_IN_MB=mb`, set
    before TensorFlow is imported). Over-large batches then fail with a
    genuine `ResourceExhaustedError`, and the process recovers. oneDNN is
    turned off there: its kernels crash (SIGSEGV) instead of raising when the
    capped allocator refuses them. Each real OOM costs about 10 s.

Fault injection
    The `inject_oom` fixture makes every compiled step keras_memfit builds
    raise a real OOM error of the active backend (`support.oom_error`:
    TensorFlow's `ResourceExhaustedError`, JAX's `RESOURCE_EXHAUSTED`
    `JaxRuntimeError`) when its batch has more rows than a threshold, either
    before the step runs or after it ran (to check that state a failed step
    touched is rolled back; on JAX a train step writes nothing before it
    succeeded, so there a late OOM is raised before it). It logs every
    call; ask it with `inject_oom.ooms(phase)` (rows of the calls that
    raised), `inject_oom.ok_rows(phase)` (rows of those that succeeded) and
    `inject_oom.rows(phase)` (all), the phase being optional. Under a
    `tf.distribute` strategy (`two_devices`) MemFit's replica steps fail
    alike, a batch's rows being its largest replica's. Other fault
    fixtures swap the backend's steps with `support.wrap_factory` too.

Shared models, data, callbacks and comparisons are in `support.py`.
"""

from __future__ import annotations

import os
from typing import List, NamedTuple, Optional

import pytest

CAPPED_ENV = "KERAS_MEMFIT_TEST_CAPPED"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The compatibility subset (`pytest -m compat`), run by .ci/run on the older
# TensorFlow + Keras pairs: the modules that exercise what moves between Keras
# releases (MemFit's train steps and Keras's training loop, MemFit among
# Keras's callbacks, safe_predict's outputs and out=, evaluate's metrics, data
# adapters, the symbolic trace of memory_report, placement and its gradients)
# and real OOMs under a capped allocator. Every test of these modules gets the
# `compat` marker. (The test_conformance_* modules compare against the
# installed Keras's own predict/evaluate/fit, whose behaviour older releases
# do not share: they run in the full suite, on the newest Keras.)
COMPAT_MODULES = (
    "test_call_on_device.py",
    "test_callbacks.py",
    "test_data.py",
    "test_evaluate.py",
    "test_memfit_accumulate.py",
    "test_memfit_compat.py",
    "test_memfit_shrink.py",
    "test_placement.py",
    "test_predict_outputs.py",
    "test_real_oom.py",
    "test_real_oom_fit.py",
    "test_report.py",
)


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "memory_cap(mb): run the test in a subprocess whose CPU allocator is capped "
        "at `mb` MiB, so that over-large batches hit a real ResourceExhaustedError",
    )
    config.addinivalue_line(
        "markers", "gpu: needs a real GPU; skipped where TensorFlow sees none"
    )
    config.addinivalue_line(
        "markers",
        "two_devices: run in a subprocess whose CPU is split into two logical devices "
        "(/CPU:1 stands in for an accelerator); one subprocess per test module",
    )
    config.addinivalue_line(
        "markers",
        "tensorflow(reason=...): exercises TensorFlow itself (its allocator, tf.function "
        "steps, place, what only Keras on TensorFlow accepts); skipped with the reason "
        "when Keras runs on another backend (KERAS_BACKEND)",
    )
    config.addinivalue_line(
        "markers",
        "not_on_torch(reason=...): needs what Keras's torch backend does not have (e.g. "
        "steps_per_execution > 1, which its trainer refuses); skipped with the reason "
        "under KERAS_BACKEND=torch",
    )
    config.addinivalue_line(
        "markers",
        "compat: the compatibility subset that CI runs on older TensorFlow + Keras "
        "(every test of the modules in conftest.COMPAT_MODULES)",
    )
    missing = [m for m in COMPAT_MODULES if not os.path.exists(os.path.join(ROOT, "tests", m))]
    if missing:
        raise pytest.UsageError(
            f"conftest.COMPAT_MODULES names test modules that do not exist: {missing}; "
            "update the list"
        )
    if in_two_device_subprocess() and _backend() == "tensorflow":
        import tensorflow as tf

        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2
        )


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in COMPAT_MODULES:
            item.add_marker(pytest.mark.compat)
    _skip_tensorflow_only(items)
    _skip_not_on_torch(items)
    gpu_marked = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_marked or _backend() != "tensorflow":
        return
    import tensorflow as tf

    if not tf.config.list_physical_devices("GPU"):
        skip = pytest.mark.skip(reason="needs a real GPU; none is visible to TensorFlow")
        for item in gpu_marked:
            item.add_marker(skip)


def _backend() -> str:
    import keras

    return keras.backend.backend()


# Markers whose tests need Keras on TensorFlow, and why.
_TENSORFLOW_ONLY = {
    "tensorflow": "exercises TensorFlow itself",
    "memory_cap": "real OOMs from TensorFlow's capped BFC allocator (on JAX: "
                  "tests/test_jax_real_oom.py, under an address-space limit)",
    "two_devices": "two logical TensorFlow CPU devices",
    "gpu": "a GPU as TensorFlow sees it",
}


def _skip_not_on_torch(items) -> None:
    """Skip, with the reason, the tests marked `not_on_torch` under KERAS_BACKEND=torch."""
    marked = [item for item in items if item.get_closest_marker("not_on_torch")]
    if not marked or _backend() != "torch":
        return
    for item in marked:
        why = item.get_closest_marker("not_on_torch").kwargs.get(
            "reason", "Keras's torch backend lacks what it needs")
        item.add_marker(pytest.mark.skip(reason=f"not on KERAS_BACKEND=torch: {why}"))


def _skip_tensorflow_only(items) -> None:
    """Skip, with the reason, the tests that need Keras on TensorFlow under another backend."""
    if not any(item.get_closest_marker(name) for item in items for name in _TENSORFLOW_ONLY):
        return  # (tests/test_jax_* alone run where Keras's default backend is absent)
    active = _backend()
    if active == "tensorflow":
        return
    for item in items:
        for name, why in _TENSORFLOW_ONLY.items():
            marker = item.get_closest_marker(name)
            if marker:
                why = marker.kwargs.get("reason", why) if name == "tensorflow" else why
                item.add_marker(pytest.mark.skip(
                    reason=f"needs KERAS_BACKEND=tensorflow ({why}); Keras runs on {active}"
                ))
                break


def in_capped_subprocess() -> bool:
    return os.environ.get(CAPPED_ENV) == "1"


TWO_DEVICES_ENV = "KERAS_MEMFIT_TEST_TWO_DEVICES"
_two_device_results = {}  # module path -> (outcome per nodeid, child output)


def in_two_device_subprocess() -> bool:
    return os.environ.get(TWO_DEVICES_ENV) == "1"


def _run_child_pytest(nodeids, extra_env, timeout):
    """Run `nodeids` in a child pytest with `extra_env` set.

    Returns (outcome per nodeid from its `-rA` summary, the CompletedProcess).
    """
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **extra_env)
    from child import run_child

    result = run_child(
        ["-m", "pytest", "-q", "-p", "no:cacheprovider", "--no-header", "-rA", *nodeids],
        env, timeout,
    )
    outcomes = {}
    for line in result.stdout.splitlines():
        word, _, rest = line.partition(" ")
        if word in ("PASSED", "FAILED", "ERROR", "SKIPPED"):
            outcomes[rest.split(" - ")[0].strip()] = word
    return outcomes, result


def _run_two_devices(pyfuncitem):
    """Run the module's selected `two_devices` tests in one child; report this one."""
    path = str(pyfuncitem.path)
    if path not in _two_device_results:
        nodeids = [
            item.nodeid for item in pyfuncitem.session.items
            if str(item.path) == path and item.get_closest_marker("two_devices")
        ]
        outcomes, result = _run_child_pytest(nodeids, {TWO_DEVICES_ENV: "1"}, timeout=900)
        _two_device_results[path] = (outcomes, result.stdout + result.stderr[-3000:])
    outcomes, output = _two_device_results[path]
    if outcomes.get(pyfuncitem.nodeid) != "PASSED":
        pytest.fail(
            f"two-device subprocess: {pyfuncitem.nodeid} "
            f"{outcomes.get(pyfuncitem.nodeid, 'did not run')}:\n{output[-8000:]}",
            pytrace=False,
        )
    return True


def pytest_pyfunc_call(pyfuncitem):
    if pyfuncitem.get_closest_marker("two_devices") and not in_two_device_subprocess():
        return _run_two_devices(pyfuncitem)
    marker = pyfuncitem.get_closest_marker("memory_cap")
    if marker is None or in_capped_subprocess():
        return None
    mb = marker.kwargs.get("mb", marker.args[0] if marker.args else None)
    if not isinstance(mb, int) or mb <= 0:
        raise pytest.UsageError(
            f"memory_cap needs a positive int of MiB; received {mb!r} on {pyfuncitem.nodeid}"
        )
    from keras_memfit.app.env import capped_cpu_env

    capped = {**capped_cpu_env(mb), CAPPED_ENV: "1"}
    _, result = _run_child_pytest([pyfuncitem.nodeid], capped, timeout=600)
    passed = result.returncode == 0 and " passed" in result.stdout
    if not passed:
        pytest.fail(
            f"capped subprocess ({mb} MiB) failed with exit code {result.returncode}:\n"
            f"{result.stdout[-6000:]}\n{result.stderr[-3000:]}",
            pytrace=False,
        )
    return True


class Call(NamedTuple):
    """One call of an injected step: its phase, its batch's rows, whether it raised."""

    phase: str
    rows: int
    raised: bool


class OOMInjector:
    """Makes keras_memfit's compiled steps raise OOM above a batch-size threshold.

    Attributes:
        calls: Every call of an injected step, in order, as `Call`s
            (`(phase, rows, raised)` tuples); tests may `calls.clear()` it.
    """

    def __init__(self):
        self.threshold = None
        self.after = False
        self.phases = None
        self.calls: List[Call] = []

    def __call__(self, threshold, *, after=False, phases=None):
        """Fail batches of more than `threshold` rows (None: never).

        Args:
            threshold: Largest batch that succeeds.
            after: Raise after the real step ran (its state changes happened).
            phases: Only inject in these phases ("predict", "evaluate", "train";
                "train" covers full steps and accumulated micro-batches).
        """
        self.threshold = threshold
        self.after = after
        self.phases = phases
        return self

    def rows(self, phase: Optional[str] = None) -> List[int]:
        """Rows of every call, in order; only `phase`'s when given."""
        return [c.rows for c in self.calls if phase in (None, c.phase)]

    def ooms(self, phase: Optional[str] = None) -> List[int]:
        """Rows of the calls that raised, in order; only `phase`'s when given."""
        return [c.rows for c in self.calls if c.raised and phase in (None, c.phase)]

    def ok_rows(self, phase: Optional[str] = None) -> List[int]:
        """Rows of the calls that succeeded, in order; only `phase`'s when given."""
        return [c.rows for c in self.calls if not c.raised and phase in (None, c.phase)]

    def wrap(self, phase, step, late_runs_step=True, rows_of=None):
        """`step`, counted in `calls` and failing as configured, under `phase`.

        `late_runs_step=False`: an OOM injected `after` the step is raised
        before it runs, for steps whose computation and state write are one
        (JAX's train steps write nothing unless the whole step succeeded, so
        a late OOM leaves them exactly as an early one does). `rows_of`: a
        batch's rows (default `support.rows_of`).
        """
        from keras_memfit.backend.base import StartableStep
        from support import oom_error
        from support import rows_of as batch_rows

        rows_of = rows_of or batch_rows

        def wrapped(data):
            rows = rows_of(data)
            fail = self.fails(phase, rows)
            self.calls.append(Call(phase, rows, fail))
            if fail and (not self.after or not late_runs_step):
                raise oom_error(rows)
            result = step(data)
            if fail:
                raise oom_error(rows)
            return result

        # Keep the traced function reachable for output_spec.
        wrapped.__wrapped__ = step
        if not isinstance(step, StartableStep):
            return wrapped
        return _InjectedStartable(self, phase, step, wrapped)

    def fails(self, phase, rows):
        """Whether a call of `phase` on `rows` rows fails as configured."""
        return (
            self.threshold is not None
            and rows > self.threshold
            and (self.phases is None or phase in self.phases)
        )


class _InjectedStartable:
    """An injected predict or test step that keeps `start` (JAX's steps started ahead).

    `safe_predict`/`safe_evaluate` start such steps without waiting
    (`run_in_pieces`'s `start`), so the injected suite runs the path users
    run (see `_InjectedStarted`).
    """

    def __init__(self, injector, phase, step, call):
        self._injector, self._phase, self._step, self._call = injector, phase, step, call
        self.__wrapped__ = step

    def __call__(self, data):
        return self._call(data)

    def start(self, data):
        from support import rows_of

        rows = rows_of(data)
        return _InjectedStarted(self._injector, self._phase, rows, self._step.start(data))


class _InjectedStarted:
    """A started piece, counted in the injector's `calls` when waited for.

    Counted when waited for, not when started: a piece started after one
    that failed is dropped unwaited (its state put back), so `calls` lists
    the pieces whose outcome counted, as when each is waited for at once.
    Over the threshold it fails when waited for, as an asynchronous OOM
    does: its state is put back first (the real piece's `undo`).
    """

    def __init__(self, injector, phase, rows, started):
        self._injector, self._phase, self._rows, self._started = injector, phase, rows, started

    def wait(self):
        from support import oom_error

        fail = self._injector.fails(self._phase, self._rows)
        self._injector.calls.append(Call(self._phase, self._rows, fail))
        if fail:
            self._started.undo()
            raise oom_error(self._rows)
        return self._started.wait()

    def undo(self):
        self._started.undo()


class _InjectedTrainStep:
    """A backend `TrainStep` whose calls go through the injector.

    It satisfies the same protocol as the step it wraps (`snapshots_itself`,
    `last_outcome`). An OOM injected *before* the step leaves it untouched, as
    a real OOM at allocation time would; one injected *after* a step that
    snapshots itself ran is settled by the step as a real late OOM would be
    (TensorFlow: small state restored, `last_outcome` set). On JAX a step
    writes the model's state only once its whole computation succeeded, so a
    late OOM is raised before the step, as it leaves the state (`UNTOUCHED`).
    On torch the step has updated the weights in place once it ran whole, so
    a late OOM is raised before it too (its own restore of what a failed
    forward or backward pass touched: tests/test_torch_train_step.py).
    A custom step cannot tell (`last_outcome` stays None).
    """

    def __init__(self, injector, step, late_runs_step, rows_of=None):
        self._step = step
        self.snapshots_itself = step.snapshots_itself
        self.last_outcome = None
        self._call = injector.wrap("train", self._run, late_runs_step, rows_of)

    def _run(self, data):
        self._ran = True
        return self._step(data)

    def __call__(self, data):
        from keras_memfit.backend.base import StepOutcome

        self._ran = False
        try:
            return self._call(data)
        except Exception:
            if self.snapshots_itself and self._ran:  # failed after the real step ran
                self._step._completed -= 1
                self.last_outcome = self._step._settle()
            elif self.snapshots_itself:
                self.last_outcome = StepOutcome.UNTOUCHED
            raise  # a custom step cannot tell how far it got: last_outcome stays None


@pytest.fixture
def inject_oom(monkeypatch):
    """An `OOMInjector`; call it with the threshold: `inject_oom(100)`.

    Works on the active backend: the injected errors are that backend's real
    OOM exception objects (`support.oom_error`).
    """
    from keras_memfit._internal import cache as _cache
    from support import BACKEND, backend_module, wrap_factory

    backend = backend_module()
    # The injected thresholds are tested against the planner's probing and
    # halving; the planner of steps compiled per shape (XLA) has its own tests
    # (test_jax_compiles.py, test_tf_compiles.py).
    monkeypatch.setattr(backend, "compiles_per_shape", lambda model: False)
    late_runs_step = BACKEND == "tensorflow"  # see _InjectedTrainStep
    injector = OOMInjector()
    wrap_factory(monkeypatch, "make_predict_step", lambda step: injector.wrap("predict", step))
    wrap_factory(monkeypatch, "make_test_step", lambda step: injector.wrap("evaluate", step))

    for factory in ("make_train_step", "make_custom_train_step"):
        wrap_factory(
            monkeypatch, factory, lambda step: _InjectedTrainStep(injector, step, late_runs_step)
        )
    add = backend.training.GradientAccumulator.add

    def add_micro_batch(self, data, weight, loss_factor):
        injector.wrap("train", lambda d: add(self, d, weight, loss_factor), late_runs_step)(data)

    monkeypatch.setattr(backend.training.GradientAccumulator, "add", add_micro_batch)
    if BACKEND == "tensorflow":
        _inject_replica_steps(monkeypatch, injector, backend.distribution)
    _cache.clear()  # steps compiled before the patch would bypass it
    yield injector
    _cache.clear()


def _inject_replica_steps(monkeypatch, injector, distribution):
    """The injection on MemFit's steps under a `tf.distribute` strategy (its `Replicated`).

    A distributed batch's rows are its largest replica's (the rows MemFit
    plans). A train step that ran has applied its update: a late OOM is
    raised before it, as on JAX.
    """
    import keras

    def rows_of(data):
        leaf = next(leaf for leaf in keras.tree.flatten(data) if leaf is not None)
        return max(int(value.shape[0]) for value in leaf.values)

    replicas, accumulator = distribution.Replicated, distribution.ReplicaAccumulator
    train_step, test_step = replicas.train_step, replicas._test_step
    predict_step, add = replicas._predict_step, accumulator.add

    def add_micro_batch(self, data, weight, loss_factor):
        injector.wrap("train", lambda d: add(self, d, weight, loss_factor), True, rows_of)(data)

    monkeypatch.setattr(replicas, "train_step", lambda self, *a: _InjectedTrainStep(
        injector, train_step(self, *a), False, rows_of))
    monkeypatch.setattr(replicas, "_test_step", lambda self, *a, **k: injector.wrap(
        "evaluate", test_step(self, *a, **k), True, rows_of))
    monkeypatch.setattr(replicas, "_predict_step", lambda self, *a: injector.wrap(
        "predict", predict_step(self, *a), True, rows_of))
    monkeypatch.setattr(accumulator, "add", add_micro_batch)


@pytest.fixture
def probing_planner(monkeypatch):
    """The probing and halving planner, also where steps compile per shape (JAX).

    Tests of that planner use it (`pytestmark = pytest.mark.usefixtures(
    "probing_planner")`); the planner of steps compiled per shape (XLA) has
    its own tests (test_jax_compiles.py, test_tf_compiles.py).
    """
    from support import backend_module

    monkeypatch.setattr(backend_module(), "compiles_per_shape", lambda model: False)
