"""The backend seam's contract: what every backend package provides, typed.

keras_memfit's core (planning batch sizes, splitting batches, retrying,
MemFit's strategies, the model analysis) is backend-neutral. Everything that
depends on Keras's backend is a member of one package,
`keras_memfit.backend.<name>`; `keras_memfit.backend.get()` returns the
active one. The seam is split by concern, one protocol each (`OutOfMemory`,
`Memory`, `Steps`, `Training`, `Trainer`, `Devices`, `Tracing`,
`Distribution`), whose members are documented here once; `CONCERNS` names
the module of every backend package that provides each (`oom`, `memory`,
`steps`, `training`, `trainer`, `devices`, `tracing`, `distribution`), and
`Backend` is all of them. A new backend is a new package with those modules;
nothing outside `keras_memfit/backend/` changes.

The values that cross the seam are typed here too: a traced output's `Spec`
(or `NO_SPEC`), a model's symbolic `Trace` (`TracedCall`, `TracedTensor`), a
train step's `StepOutcome`, and the `TrainStep` (with the optional
`OrderedTrainStep`), `StartableStep`/`StartedPiece`, `Accumulator` and
`Guard` objects the step factories return.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import (
    Any,
    Callable,
    ContextManager,
    Dict,
    Iterable,
    Iterator,
    List,
    NamedTuple,
    Optional,
    Protocol,
    Sequence,
    Tuple,
    runtime_checkable,
)

import numpy as np


@dataclasses.dataclass(frozen=True)
class Spec:
    """Shape (None for unknown dimensions) and dtype of a traced output."""

    shape: Optional[Tuple[Optional[int], ...]]
    dtype: np.dtype


class _NoSpec:
    """`output_spec`'s answer for a step that cannot be traced (an eager step)."""

    _instance = None

    def __new__(cls) -> "_NoSpec":
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "NO_SPEC"


NO_SPEC = _NoSpec()


class TracedTensor(NamedTuple):
    """A tensor of a symbolic trace: `key` identifies it; `shape` starts with the batch dimension."""

    key: str
    shape: Tuple[Optional[int], ...]
    dtype: str


class TracedCall(NamedTuple):
    """One layer or operation call of a traced forward pass.

    Attributes:
        op: The layer (or operation) called.
        parent: Index of the enclosing call, None for the model's own calls.
        inputs: The tensors it was given (arguments and keyword arguments).
        outputs: The tensors it returned.
    """

    op: Any
    parent: Optional[int]
    inputs: Tuple[TracedTensor, ...]
    outputs: Tuple[TracedTensor, ...]


class Trace(NamedTuple):
    """Every layer and operation call of one symbolic forward pass of a model.

    Attributes:
        inputs: The model's input tensors.
        outputs: Keys of the model's output tensors.
        calls: Every call below the model's own, in call order.
    """

    inputs: Tuple[TracedTensor, ...]
    outputs: Tuple[str, ...]
    calls: Tuple[TracedCall, ...]


class ProcessFailed(RuntimeError):
    """Another process training together with this one failed, or did not answer in time.

    Raised by MemFit (and safe_predict, safe_evaluate) in every process of a
    multi-process run (JAX's `jax.distributed`) when one process posted a
    failure (its error is named) or did not reach the agreement within its
    timeout (`KERAS_MEMFIT_PROCESS_TIMEOUT`). Public as
    `keras_memfit.ProcessFailed`.

    Example:
        >>> try:
        ...     model.fit(x, y, callbacks=[keras_memfit.MemFit()])
        ... except keras_memfit.ProcessFailed as err:
        ...     print(err)  # "process 1 of 2 failed: ValueError(...)"
    """


class StepOutcome(enum.Enum):
    """How far a train step that raised got, as the step itself tells.

    Attributes:
        UNTOUCHED: Nothing ran (XLA, for one, allocates before it executes
            anything); nothing to undo.
        RESTORED: It ran part-way; the small state it touched is back.
        UPDATE_BEGAN: The optimizer update had begun: weights may be partly
            updated (TensorFlow) or lost (JAX, whose update program works in
            place on the state it was given), so the step must not be retried.
    """

    UNTOUCHED = "untouched"
    RESTORED = "restored"
    UPDATE_BEGAN = "update_began"


@runtime_checkable
class Guard(Protocol):
    """Copies of some variables, taken before a step and restored if it fails."""

    def snapshot(self) -> None:
        """Record the variables' current values."""

    def restore(self) -> None:
        """Put back the values recorded by the last `snapshot()`."""


@runtime_checkable
class StartedPiece(Protocol):
    """A predict or test step started on one piece and not waited for yet.

    Its new state is already the model's (the next piece's step reads it);
    its result is not known to exist until `wait()` returned.
    """

    def wait(self) -> Any:
        """The step's result. If the step failed, the state is put back as it
        was before the step started, then the error is raised."""

    def undo(self) -> None:
        """Put the state back as it was before the step started (its result is dropped)."""


@runtime_checkable
class StartableStep(Protocol):
    """A predict or test step that can also be started without waiting.

    Where a backend's steps run asynchronously (JAX), waiting for each piece
    before dispatching the next loses the overlap of one piece's computation
    with the next one's dispatch; `runner.run_in_pieces` keeps pieces
    started ahead with `start` (see there).
    """

    def __call__(self, data: Any) -> Any:
        """Run the step on `data` and wait for it; returns its result."""

    def start(self, data: Any) -> StartedPiece:
        """Start the step on `data` without waiting for its result."""


@runtime_checkable
class TrainStep(Protocol):
    """One compiled train step on a batch, returning Keras's logs.

    Attributes:
        snapshots_itself: True when the step snapshots and restores the small
            state it may touch inside its own call (keras_memfit's version of
            Keras's default step); False for a model's own `train_step`,
            whose caller must snapshot with a `Guard`.
        last_outcome: After a call raised, how far it got; None where the
            step cannot tell (a custom `train_step`).
    """

    snapshots_itself: bool
    last_outcome: Optional[StepOutcome]

    def __call__(self, data: Any) -> Dict[str, Any]:
        """Run one step on the Keras batch `data`; returns the logs."""


@runtime_checkable
class OrderedTrainStep(TrainStep, Protocol):
    """A `TrainStep` that chooses, per call, when its optimizer update may begin.

    TensorFlow's default step (`backend/tensorflow/training.py`): in the
    strict order the update waits for every gradient (any OOM before it is
    retriable); in the free order it may begin once one gradient exists, as
    in Keras's own step (a lower peak where the weights dominate). It runs
    strict where that costs little against the estimated peak of the step.
    """

    def use_peak_estimate(self, peak_at: Callable[[int], Optional[int]]) -> None:
        """Give the estimated training peak in bytes at a number of rows (None: unknown)."""


@runtime_checkable
class Accumulator(Protocol):
    """Sums weighted micro-batch gradients and applies them as one optimizer step."""

    def reset(self) -> None:
        """Start a new batch: zero the sums."""

    def add(self, data: Any, weight: float, loss_factor: float) -> None:
        """Add `weight` times the gradient of the loss on micro-batch `data`; the loss
        tracker records its loss times `loss_factor` (`_internal.reductions.weights`)."""

    def apply(self) -> None:
        """Apply the summed gradients as one optimizer step."""

    def held(self) -> Optional[str]:
        """What the last `apply` held that grows with the batch, in words; None: only sums.

        For the message of an OOM in the update: None when it held sums the
        size of the weights (memory that does not depend on the batch size).
        """


# ---------------------------------------------------------------- the seam
# One protocol per concern, each provided by the module of that name in every
# backend package (`CONCERNS`). The members are documented here, once; a
# backend's function says only what is its own.


class OutOfMemory(Protocol):
    """The framework's own out-of-memory errors (module `oom`).

    The forms every backend shares are in `keras_memfit.oom`; these are the
    framework's own, and the classes `OutOfMemoryError` is made on.
    """

    def is_oom_error(self, exc: BaseException) -> bool:
        """Whether `exc` is one of the framework's own out-of-memory forms."""

    def oom_error_bases(self) -> Tuple[type, ...]:
        """The bases of `OutOfMemoryError`: the framework's OOM error class, so
        that existing `except` clauses for it still catch keras_memfit's."""

    def init_oom_error(self, err: BaseException, message: str) -> None:
        """Initialize `err`, an `OutOfMemoryError`, as its framework base with `message`."""


class Memory(Protocol):
    """Memory statistics and limits of a device, for the planner (module `memory`)."""

    def compute_device(self) -> str:
        """The device the model's computation runs on, named as the backend names devices."""

    def memory_stats(self, device: str) -> Optional[Tuple[int, int]]:
        """`(current, peak)` bytes allocated on `device` since `reset_peak`, or
        None where the device reports none (the planner then learns from OOMs)."""

    def memory_limit(self, device: str) -> Optional[Tuple[int, bool]]:
        """`(bytes, exact)`: what the allocator on `device` may use, and whether
        the planner may trust it before a first OOM; None when unknown."""

    def reset_peak(self, device: str) -> None:
        """Start a new peak measurement on `device` (nothing where unsupported)."""

    def conv_columns(self, model: Any, device: str) -> bool:
        """Whether a convolution's backward pass in `model`'s train step on
        `device` builds its input's column matrix (the kernel's size times the
        input), a workspace no recomputation frees."""

    def compiles_per_shape(self, model: Any) -> bool:
        """Whether `model`'s steps compile once per piece shape (XLA).

        Each new piece size then costs a compilation, so the planner avoids
        probe sizes and keeps few shapes.

        Example:
            >>> backend.get().compiles_per_shape(model)  # on JAX
            True
        """


class Steps(Protocol):
    """Inference steps, their traced outputs, undoing their state (module `steps`).

    A step that fails leaves the model as it was before it. Under a
    distribution the backend chooses, when it makes a step, how its pieces
    run (on every replica, laid out over the devices); callers do not see it.

    Attributes:
        KERAS_COUNTS_EACH_BATCH_ONCE: Whether Keras's own test step counts each
            batch once in per-output losses (a step traced with an unknown
            batch size), rather than per sample.
        KERAS_BEGINS_BATCH_BEFORE_FETCH: Whether Keras's predict and evaluate
            loops call `on_*_batch_begin` before fetching the batch (once
            more, for a batch that never came, when a generator runs out) or
            after it.
    """

    KERAS_COUNTS_EACH_BATCH_ONCE: bool
    KERAS_BEGINS_BATCH_BEFORE_FETCH: bool

    def make_predict_step(self, model: Any, postprocess: Optional[Callable] = None) -> Callable:
        """A step `x -> outputs` running `model.predict_step`, then `postprocess`.

        It may also be a `StartableStep` (steps that run asynchronously).

        Example:
            >>> outputs = backend.get().make_predict_step(model)(x[:64])
        """

    def make_test_step(self, model: Any, exact: bool = False) -> Callable:
        """A step `(x, y, sample_weight) -> logs` running `model.test_step`.

        Args:
            model: A compiled model.
            exact: Count per-output losses per sample, where Keras's own step
                counts each batch once (`KERAS_COUNTS_EACH_BATCH_ONCE`);
                elsewhere every step already counts per sample.

        Example:
            >>> logs = backend.get().make_test_step(model)((x[:64], y[:64], None))
        """

    def prepare_test(self, model: Any, batch: Any) -> None:
        """Build `model`, its compiled metrics and loss on `batch` before test steps run."""

    def output_spec(self, step: Callable, x: Any) -> Any:
        """The output structure of `step(x)` by tracing only; `NO_SPEC` where it cannot be traced.

        Each array leaf becomes a `Spec` whose dimensions that follow the
        batch size are None; a leaf that is not an array is returned as it
        is. A wrapper's `__wrapped__` step is traced.

        Example:
            >>> backend.get().output_spec(make_predict_step(model), x[:8])
            Spec(shape=(None, 10), dtype=dtype('float32'))
        """

    def guard_variables(self, variables: Sequence[Any]) -> Guard:
        """A `Guard` over `variables`: snapshot before a step, restored if it fails."""


class Training(Protocol):
    """MemFit's train steps and gradient accumulation (module `training`).

    The backend chooses once, when it makes a step, how it runs under the
    active distribution (one device, replicas or devices, several
    processes); callers do not see it.
    """

    def check_training_mode(self, model: Any, mode: str) -> None:
        """Raise where MemFit cannot train `model` in `mode` ("accumulate" or "shrink") here.

        Under several processes every batch is one agreement of every
        process, so one update of all: only "accumulate", with Keras's
        default `train_step` and losses reduced with "sum_over_batch_size" or
        "mean". Nothing elsewhere.

        Raises:
            NotImplementedError: Naming what was received and what to do.
        """

    def make_train_step(self, model: Any) -> TrainStep:
        """A `TrainStep` running Keras's default `train_step` on `model`.

        Example:
            >>> logs = backend.get().make_train_step(model)((x[:64], y[:64]))
        """

    def make_custom_train_step(self, model: Any, data: Any) -> TrainStep:
        """A `TrainStep` running the model's own `train_step`.

        Made ready as Keras makes its own on `data`, Keras's first batch
        (TensorFlow traces it there, which builds the model).
        """

    def checkpoint(self, fn: Callable) -> Callable:
        """`fn`, a function of tensors, recomputed in the backward pass (rematerialization).

        What `fn` computes is not kept for the gradients: the backward pass
        runs `fn` again on the same inputs (`tf.recompute_grad`,
        `jax.checkpoint`, torch's non-reentrant `checkpoint`). `fn` takes
        and returns tensors only (nested outputs allowed); the caller closes
        over everything else.

        Example:
            >>> block = backend.get().checkpoint(lambda x: layer(x, training=True))
        """

    def make_accumulator(self, model: Any) -> Accumulator:
        """An `Accumulator` over `model`'s trainable weights.

        Example:
            >>> acc = backend.get().make_accumulator(model)
            >>> acc.reset(); acc.add((x[:32], y[:32]), 0.5, 1.0)
            >>> acc.add((x[32:], y[32:]), 0.5, 1.0)
            >>> acc.apply()
        """


class Trainer(Protocol):
    """Keras's step functions in the backend's calling convention (module `trainer`)."""

    def step_function(
        self, model: Any, kind: str, run_batches: Callable[[Iterable[Any]], Any]
    ) -> Callable:
        """A replacement for `model.<kind>_function` that runs `run_batches`.

        Args:
            model: The model whose function is replaced.
            kind: "train", "test" or "predict" (`STEP_KINDS`).
            run_batches: Runs Keras batches (train and test batches are
                pulled one at a time as it asks for them); returns what
                Keras expects of the function (the logs; for "predict",
                the batches' outputs).

        Raises:
            ValueError: If `kind` is not one of the three (`check_step_kind`).

        Example:
            >>> model.train_function = step_function(model, "train", run.train)
        """

    def is_end_of_data(self, exc: BaseException) -> bool:
        """Whether `exc` is how an epoch's iterator says it has no batch left."""

    def adapter_batches(self, adapter: Any) -> Iterator[Any]:
        """The batches of a Keras data adapter, in the form Keras's loops hand them to a step."""

    def call_keras_function(
        self, model: Any, kind: str, function: Callable, batches: List[Any]
    ) -> Any:
        """Keras's own `<kind>_function` on `batches` (those MemFit passes through unsplit).

        `function` is the one Keras made, saved before MemFit installed its
        own; returns what it returned (the logs; for "predict", the outputs).

        Example:
            >>> logs = call_keras_function(model, "train", keras_train_function, batches)
        """

    def materialize(self, model: Any) -> None:
        """Inside Keras's loops, put the state the backend threads through its
        steps into the model's variables, so that an eager call reads it."""


class Devices(Protocol):
    """Naming devices; placing variables and calls for `place` (module `devices`).

    Attributes:
        PLACES_LAYERS: Whether `place` can keep layers on another device.
            False: the five placement functions (`device_scope`,
            `move_variable`, `creating_on`, `call_on_device`,
            `follow_variable_devices`) raise `NotImplementedError` with the
            backend's reason.
    """

    PLACES_LAYERS: bool

    def host_device(self) -> str:
        """The host device, that layers kept off the accelerator live on."""

    def list_accelerators(self) -> List[str]:
        """The canonical names of the devices other than the host."""

    def canonical_device(self, name: str) -> Optional[str]:
        """`name` as the backend names its devices, or None if unparsable."""

    def device_exists(self, name: str) -> bool:
        """Whether `name` (canonical) is one of the backend's devices."""

    def device_scope(self, device: str) -> ContextManager[Any]:
        """A context placing ops and new variables on `device`."""

    def variable_device(self, variable: Any) -> Optional[str]:
        """The canonical device of a Keras variable's value; None if it has none yet."""

    def move_variable(self, variable: Any, device: str) -> bool:
        """Move a built variable's storage to `device`, keeping its value; whether it moved."""

    def creating_on(self, device: str, add_weight: Callable) -> Callable:
        """`add_weight` creating its variable on `device`."""

    def call_on_device(self, device: str, call: Callable) -> Callable:
        """`call` whose ops run on `device`, its gradients included."""

    def follow_variable_devices(self, optimizer: Any) -> None:
        """Make `optimizer` create each slot, and run each update, on its variable's device."""


class Tracing(Protocol):
    """The model's layer calls, traced symbolically (module `tracing`), for the analysis."""

    def trace_layer_calls(self, model: Any) -> Trace:
        """Every layer and operation call of one symbolic forward pass of `model`.

        Nothing runs and nothing is allocated; the calls are recorded by
        wrapping `Layer.__call__` and `Operation.__call__` for the trace.

        Args:
            model: A built Keras model.

        Returns:
            The `Trace`: the model's input tensors, its output keys and every
            call below the model's own, in call order (`parent` None for the
            model's direct children). Shapes have None for the batch
            dimension (and any other dimension that follows the batch size).

        Raises:
            ValueError: If the model has not been built, or its forward pass
                makes different calls at two batch sizes.

        Example:
            >>> trace = backend.get().trace_layer_calls(model)
            >>> [type(call.op).__name__ for call in trace.calls][:2]
            ['Conv2D', 'Conv2D']
        """


class Distribution(Protocol):
    """How the backend runs under a distribution (module `distribution`).

    What the library asks about replicas, devices and processes; how the
    steps are laid out over them stays in the backend, chosen when a step
    is made (`Steps`, `Training`).
    """

    def distribution_of(self, model: Any) -> Optional[str]:
        """The distribution `model` runs under, named for messages, or None.

        A question only, refusing nothing.

        Example:
            >>> backend.get().distribution_of(model)  # under MirroredStrategy
            'tf.distribute.MirroredStrategy'
        """

    def training_replicas(self, model: Any) -> Optional[Any]:
        """May MemFit train under the current distribution, and how.

        Returns:
            The replicas whose rows MemFit splits alike (a `tf.distribute`
            strategy's), or None where batches are split whole (no
            distribution, JAX's `DataParallel`).

        Raises:
            NotImplementedError: For a distribution MemFit refuses, naming
                what was received.
        """

    def replica_devices(self, model: Any) -> Tuple[str, ...]:
        """The devices of `model`'s replicas when each piece is split across several; else ().

        The planner then sizes each piece for all of them: the budget is
        the smallest free memory among them, the measured peak the largest.
        () when every piece runs on `compute_device()`.
        """

    def piece_multiple(self) -> int:
        """What every planned piece size must be a multiple of (the devices a
        batch is laid out over); 1 for any size."""

    def evaluation(self, model: Any) -> ContextManager[None]:
        """Around a standalone evaluate's batches (`safe_evaluate`), for several processes.

        With several processes, an error raised inside is told to the other
        processes (they stop at once), and at its end each process's metric
        state (its own rows') becomes the sum over the processes (one
        agreement, one sum), as Keras's multi-process evaluate reports.
        Nothing with one process.

        Example:
            >>> with backend.get().evaluation(model):
            ...     run_batches()
        """


# Each concern's module in every backend package, and the protocol it provides.
CONCERNS: Tuple[Tuple[str, type], ...] = (
    ("oom", OutOfMemory),
    ("memory", Memory),
    ("steps", Steps),
    ("training", Training),
    ("trainer", Trainer),
    ("devices", Devices),
    ("tracing", Tracing),
    ("distribution", Distribution),
)


class Backend(
    OutOfMemory, Memory, Steps, Training, Trainer, Devices, Tracing, Distribution, Protocol
):
    """What `keras_memfit.backend.get()` returns: every concern's members (`CONCERNS`)."""


def members(protocol: type) -> Tuple[str, ...]:
    """The names a concern's protocol declares: its attributes, then its methods.

    Example:
        >>> members(OutOfMemory)
        ('is_oom_error', 'oom_error_bases', 'init_oom_error')
    """
    own = vars(protocol)
    methods = tuple(
        name for name, value in own.items() if callable(value) and not name.startswith("_")
    )
    return tuple(own.get("__annotations__", {})) + methods


# ------------------------------------------- shared by the backends' modules
def model_of(model_ref: Callable[[], Any]) -> Any:
    """The model a step holds weakly (`model_ref`, a `weakref.ref`).

    Raises:
        RuntimeError: If the model was deleted.
    """
    model = model_ref()
    if model is None:
        raise RuntimeError("the model of this step was deleted")
    return model


# What `Trainer.step_function` accepts as its `kind`.
STEP_KINDS = ("train", "test", "predict")


def check_step_kind(kind: str) -> None:
    """Raise `ValueError` unless `kind` is one of `STEP_KINDS`."""
    if kind not in STEP_KINDS:
        raise ValueError(f"kind must be one of {list(STEP_KINDS)}; received kind={kind!r}")
