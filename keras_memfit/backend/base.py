"""The backend seam's contract: what every backend package provides, typed.

Everything that depends on Keras's backend is a member of one package,
`keras_memfit.backend.<name>`, whose `__init__` imports it from the modules
named below; `keras_memfit.backend.get()` returns the active one. `Backend`
is every concern's protocol together. A capability a backend lacks is None
(`placement` on JAX and torch). The values that cross the seam are typed
here too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from typing import (
    Any,
    Callable,
    ContextManager,
    Dict,
    Hashable,
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

import keras
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
    """A tensor of a symbolic trace: `key` identifies it; `shape` starts with the batch axis."""

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
    """A predict or test step that can also be started without waiting (JAX)."""

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
        """What the last `apply` held that grows with the batch, in words; None: only sums."""


class Cut(Protocol):
    """One Keras batch as a `Layout` cuts it.

    `chunk` is what `run_in_pieces` cuts, its rows the batch's lanes (`lanes`, what the planner
    sizes: its rows on one device, its largest replica's rows under a strategy); `rows`: the
    batch's rows on every device; `signature`: the planner's key; `x`: one
    device's inputs (for MemFit's warnings).
    """

    chunk: tuple
    lanes: int
    rows: int
    signature: Hashable
    x: Any

    def batch(self, piece: tuple) -> Any:
        """The Keras batch of `piece`'s rows, as the layout's steps take it."""

    def micro_batch(self, piece: tuple, how: str) -> Tuple[Any, Any, Any]:
        """`piece`'s batch, weight and loss factor for `Accumulator.add` (`how`: a weighting)."""

    def rows_in(self, piece: tuple) -> int:
        """The rows `piece` runs, on every device."""

    def join(self, outputs: List[Any]) -> Any:
        """The predict step's outputs on consecutive pieces, as one, in the input's order."""


class Layout(Protocol):
    """How MemFit cuts a Keras batch into pieces, and the steps that run them.

    On one device `training.layout.OneDevice`; a backend that runs a batch on several replicas
    each with its own rows gives its own (`Distribution.training_layout`).

    Attributes:
        copies: Each replica's copy of a variable (per-output loss trackers are settled on
            each); None on one device.
    """

    copies: Optional[Callable[[Any], Sequence[Any]]]

    def cut(self, batch: Any) -> Optional[Cut]:
        """`batch` as a `Cut`, or None when it cannot be split."""

    def unsplittable(self, batches: Iterable[Any]) -> Optional[str]:
        """What cannot be split in `batches`, in words (None: everything can)."""

    def prepare(self, model: Any, cut: Cut) -> None:
        """Build the model, its metrics and loss (and optimizer) before a train step is made."""

    def train_step(self, model: Any, custom: bool, cut: Cut) -> TrainStep:
        """The train step (the model's own `train_step` when `custom`)."""

    def guard(self, variables: Sequence[Any]) -> Guard:
        """A `Guard` over (every copy of) `variables`."""

    def accumulator(self, model: Any) -> Accumulator:
        """A gradient accumulator (sums the size of the weights)."""

    def test_step(self, model: Any, cut: Cut, exact: bool) -> Tuple[Callable[[Any], Any], Guard]:
        """The test step on a cut's batch and a guard over the metric state; `exact`: per-output
        loss trackers weight a piece by its rows (else as Keras's `evaluate` counts a batch)."""

    def predict_step(self, model: Any) -> Callable[[Any], Any]:
        """The predict step on a cut's batch."""


# ---------------------------------------------------------------- the seam
# One protocol per concern, provided by the module of that name in every
# backend package. The members are documented here, once.


class OutOfMemory(Protocol):
    """The framework's own out-of-memory errors (module `oom`)."""

    def is_oom_error(self, exc: BaseException) -> bool:
        """Whether `exc` is one of the framework's own out-of-memory forms."""

    def oom_error_bases(self) -> Tuple[type, ...]:
        """The framework's OOM error classes, the bases of `OutOfMemoryError`."""

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
        """Whether `model`'s steps compile once per piece shape (XLA)."""


class Steps(Protocol):
    """Inference steps, their traced outputs, undoing their state (module `steps`).

    A step that fails leaves the model as it was before it.

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
        """A step `x -> outputs` running `model.predict_step`, then `postprocess`
        (a `StartableStep` where steps run asynchronously)."""

    def make_test_step(self, model: Any, exact: bool = False) -> Callable:
        """A step `(x, y, sample_weight) -> logs` running `model.test_step`.

        Args:
            model: A compiled model.
            exact: Count per-output losses per sample, where Keras's own step
                counts each batch once (`KERAS_COUNTS_EACH_BATCH_ONCE`).
        """

    def prepare_test(self, model: Any, batch: Any) -> None:
        """Build `model`, its compiled metrics and loss on `batch` before test steps run."""

    def output_spec(self, step: Callable, x: Any) -> Any:
        """The output structure of `step(x)` by tracing only; `NO_SPEC` where it cannot be traced.

        Each array leaf becomes a `Spec` whose dimensions that follow the
        batch size are None; other leaves are returned as they are.
        """

    def guard_variables(self, variables: Sequence[Any]) -> Guard:
        """A `Guard` over `variables`: snapshot before a step, restored if it fails."""


class Training(Protocol):
    """MemFit's train steps and gradient accumulation (module `training`)."""

    def check_training_mode(self, model: Any, mode: str) -> None:
        """Raise where MemFit cannot train `model` in `mode` ("accumulate" or "shrink") here.

        Raises:
            NotImplementedError: Naming what was received and what to do.
        """

    def make_train_step(
        self, model: Any, peak_at: Optional[Callable[[int], Optional[int]]] = None
    ) -> TrainStep:
        """A `TrainStep` running Keras's default `train_step` on `model`.

        `peak_at(rows)`: the estimated training peak in bytes (None: unknown), for a backend
        whose step chooses by it when its update may begin (TensorFlow).
        """

    def make_custom_train_step(self, model: Any, data: Any) -> TrainStep:
        """A `TrainStep` running the model's own `train_step`, made ready on Keras's first batch."""

    def checkpoint(self, fn: Callable) -> Callable:
        """`fn`, a function of tensors, recomputed in the backward pass (rematerialization).

        `fn` takes and returns tensors only (nested outputs allowed); the
        caller closes over everything else.
        """

    def make_accumulator(self, model: Any) -> Accumulator:
        """An `Accumulator` over `model`'s trainable weights."""


class KerasFunctions(Protocol):
    """Keras's step functions in the backend's calling convention (module `keras_functions`)."""

    def keras_call(self, model: Any, kind: str, *args: Any) -> "KerasCall":
        """One call of MemFit's `model.<kind>_function` by Keras, on Keras's arguments `args`.

        Raises:
            ValueError: If `kind` is not one of `STEP_KINDS`.
        """

    def is_end_of_data(self, exc: BaseException) -> bool:
        """Whether `exc` is how an epoch's iterator says it has no batch left."""

    def adapter_batches(self, adapter: Any) -> Iterator[Any]:
        """The batches of a Keras data adapter, in the form Keras's loops hand them to a step."""

    def call_keras_function(
        self, model: Any, kind: str, function: Callable, batches: List[Any]
    ) -> Any:
        """Keras's own `<kind>_function` (saved before MemFit's) on `batches`; what it returns."""

    def materialize(self, model: Any) -> None:
        """Inside Keras's loops, put the state the backend threads through its
        steps into the model's variables, so that an eager call reads it."""


class Placement(Protocol):
    """Keeping layers on another device, for `place` (module `placement`, TensorFlow only)."""

    def device_scope(self, device: str) -> ContextManager[Any]:
        """A context placing ops and new variables on `device`."""

    def move_variable(self, variable: Any, device: str) -> bool:
        """Move a built variable's storage to `device`, keeping its value; whether it moved."""

    def creating_on(self, device: str, add_weight: Callable) -> Callable:
        """`add_weight` creating its variable on `device`."""

    def call_on_device(self, device: str, call: Callable) -> Callable:
        """`call` whose ops run on `device`, its gradients included."""

    def follow_variable_devices(self, optimizer: Any) -> None:
        """Make `optimizer` create each slot, and run each update, on its variable's device."""


class Devices(Protocol):
    """Naming devices (module `devices`); `placement`: the capability, None where absent."""

    placement: Optional[Placement]

    def host_device(self) -> str:
        """The host device, that layers kept off the accelerator live on."""

    def list_accelerators(self) -> List[str]:
        """The canonical names of the devices other than the host."""

    def canonical_device(self, name: str) -> Optional[str]:
        """`name` as the backend names its devices, or None if unparsable."""

    def device_exists(self, name: str) -> bool:
        """Whether `name` (canonical) is one of the backend's devices."""

    def variable_device(self, variable: Any) -> Optional[str]:
        """The canonical device of a Keras variable's value; None if it has none yet."""


class Tracing(Protocol):
    """The model's layer calls, traced symbolically (module `tracing`), for the analysis."""

    def trace_layer_calls(self, model: Any) -> Trace:
        """Every layer and operation call of one symbolic forward pass of `model`.

        Nothing runs and nothing is allocated.

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
        """


class Distribution(Protocol):
    """What the library asks about replicas, devices and processes (module `distribution`)."""

    def distribution_of(self, model: Any) -> Optional[str]:
        """The distribution `model` runs under, named for messages, or None."""

    def training_layout(self, model: Any) -> Optional[Layout]:
        """May MemFit train under the current distribution, and how.

        Returns:
            The backend's `Layout` of the batches (a `tf.distribute`
            strategy's replicas), or None where batches are split whole on
            one device or laid out by the steps (JAX's `DataParallel`).

        Raises:
            NotImplementedError: For a distribution MemFit refuses, naming
                what was received.
        """

    def replica_devices(self, model: Any) -> Tuple[str, ...]:
        """The devices of `model`'s replicas when each piece is split across several; else ()."""

    def step_variant(self, model: Any) -> Hashable:
        """How a step made now for `model` runs (one device, a strategy's replicas, the devices
        of a `DataParallel`, several processes): part of every step's cache key."""

    def piece_multiple(self) -> int:
        """What every planned piece size must be a multiple of (the devices a
        batch is laid out over); 1 for any size."""

    def evaluation(self, model: Any) -> ContextManager[None]:
        """Around `safe_evaluate`'s batches: under several processes, a failure told to the
        others and the metrics summed across them once; nothing with one process."""


class Backend(
    OutOfMemory, Memory, Steps, Training, KerasFunctions, Devices, Tracing, Distribution, Protocol
):
    """What `keras_memfit.backend.get()` returns: every concern's members."""


# ------------------------------------------------------ the seam's defaults
# A backend with nothing to do for one of these members imports it from here:
# one process, and the model's variables hold its state inside Keras's loops.
def check_training_mode(model: Any, mode: str) -> None:
    """Nothing to refuse."""


def materialize(model: Any) -> None:
    """Nothing to write: the variables hold the state."""


def evaluation(model: Any) -> ContextManager[None]:
    """Nothing around the batches."""
    return contextlib.nullcontext()


# ------------------------------------------- shared by the backends' modules
def spec_of_two_sizes(a: Any, b: Any, dtype_of: Callable[[Any], Optional[np.dtype]]) -> Any:
    """`Spec`s of a step's outputs traced at two batch sizes (`a`, `b`): a dimension that
    differs follows the batch (None). `dtype_of(leaf)`: None for a leaf that is no array."""

    def describe(left: Any, right: Any) -> Any:
        dtype = dtype_of(left)
        if dtype is None:
            return left
        if len(left.shape) != len(right.shape):
            return Spec(None, dtype)
        shape = tuple(None if x != y else int(x) for x, y in zip(left.shape, right.shape))
        return Spec(shape, dtype)

    return keras.tree.map_structure(describe, a, b)


def model_of(model_ref: Callable[[], Any]) -> Any:
    """The model a step holds weakly (`model_ref`, a `weakref.ref`).

    Raises:
        RuntimeError: If the model was deleted.
    """
    model = model_ref()
    if model is None:
        raise RuntimeError("the model of this step was deleted")
    return model


class KerasCall:
    """One call of MemFit's `model.<kind>_function` by Keras, as the backend's trainer makes it.

    Entered around `run_batches(call.batches)`: `batches` are the Keras batches of the call
    (train and test batches pulled one at a time as they are asked for); `returned(result)` is
    what the function gives back to Keras. This default hands the result back as it is.
    """

    def __init__(self, batches: Iterable[Any]) -> None:
        self.batches = batches

    def __enter__(self) -> "KerasCall":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        return None

    def returned(self, result: Any) -> Any:
        return result


# What `KerasFunctions.keras_call` accepts as its `kind`.
STEP_KINDS = ("train", "test", "predict")


def check_step_kind(kind: str) -> None:
    """Raise `ValueError` unless `kind` is one of `STEP_KINDS`."""
    if kind not in STEP_KINDS:
        raise ValueError(f"kind must be one of {list(STEP_KINDS)}; received kind={kind!r}")
