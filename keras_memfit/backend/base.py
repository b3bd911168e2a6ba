"""The backend seam's contract: what every backend package provides, typed.

`Backend` is every concern's protocol together; a capability a backend lacks is None.
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
    """`output_spec`'s answer for a step that cannot be traced."""

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
    """One layer or operation call of a traced forward pass (`parent`: None for the model's own)."""

    op: Any
    parent: Optional[int]
    inputs: Tuple[TracedTensor, ...]
    outputs: Tuple[TracedTensor, ...]


class Trace(NamedTuple):
    """Every layer and operation call below the model's own of one symbolic forward pass."""

    inputs: Tuple[TracedTensor, ...]
    outputs: Tuple[str, ...]
    calls: Tuple[TracedCall, ...]


class ProcessFailed(RuntimeError):
    """Another process of a multi-process run failed, or did not answer in time."""


class StepOutcome(enum.Enum):
    """How far a train step that raised got.

    Attributes:
        UNTOUCHED: Nothing ran; nothing to undo.
        RESTORED: It ran part-way; the small state it touched is back.
        UPDATE_BEGAN: The update began: weights may be partly updated or lost; never retried.
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
    """A predict or test step started on one piece, its new state already the model's."""

    def wait(self) -> Any:
        """The step's result; if the step failed, the state is put back first."""

    def undo(self) -> None:
        """Put the state back as it was before the step started."""


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
        snapshots_itself: Whether the step restores what it touched itself (else use a `Guard`).
        last_outcome: After a call raised, how far it got; None where the step cannot tell.
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
        """Add `weight` times `data`'s loss gradient; its loss is tracked times `loss_factor`."""

    def apply(self) -> None:
        """Apply the summed gradients as one optimizer step."""

    def held(self) -> Optional[str]:
        """What the last `apply` held that grows with the batch, in words; None if nothing."""


class Cut(Protocol):
    """One Keras batch as a `Layout` cuts it (ARCHITECTURE.md, "cut").

    `chunk`: what `run_in_pieces` cuts; `lanes`: what the planner sizes; `rows`: on every
    device; `signature`: the planner's key; `x`: one device's inputs.
    """

    chunk: tuple
    lanes: int
    rows: int
    signature: Hashable
    x: Any

    def batch(self, piece: tuple) -> Any:
        """The Keras batch of `piece`'s rows, as the layout's steps take it."""

    def micro_batch(self, piece: tuple, how: str) -> Tuple[Any, Any, Any]:
        """`piece`'s batch, weight and loss factor for `Accumulator.add`."""

    def rows_in(self, piece: tuple) -> int:
        """The rows `piece` runs, on every device."""

    def join(self, outputs: List[Any]) -> Any:
        """The predict step's outputs on consecutive pieces, as one."""


class Layout(Protocol):
    """How MemFit cuts a Keras batch into pieces, and the steps that run them.

    Attributes:
        copies: Each replica's copy of a variable; None on one device.
    """

    copies: Optional[Callable[[Any], Sequence[Any]]]

    def cut(self, batch: Any) -> Optional[Cut]:
        """`batch` as a `Cut`, or None when it cannot be split."""

    def unsplittable(self, batches: Iterable[Any]) -> Optional[str]:
        """What cannot be split in `batches`, in words (None: everything can)."""

    def prepare(self, model: Any, cut: Cut) -> None:
        """Build the model, its metrics, loss and optimizer before a train step is made."""

    def train_step(self, model: Any, custom: bool, cut: Cut) -> TrainStep:
        """The train step (the model's own `train_step` when `custom`)."""

    def accumulator(self, model: Any) -> Accumulator:
        """A gradient accumulator."""

    def test_step(self, model: Any, cut: Cut, exact: bool) -> Tuple[Callable[[Any], Any], Guard]:
        """The test step and a guard over the metric state (`exact`: losses weighted by rows)."""

    def predict_step(self, model: Any) -> Callable[[Any], Any]:
        """The predict step on a cut's batch."""


# ---------------------------------------------------------------- the seam
# One protocol per concern, provided by the module of that name in every backend package.


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
        """The device the model's computation runs on."""

    def memory_stats(self, device: str) -> Optional[Tuple[int, int]]:
        """`(current, peak)` bytes allocated on `device` since `reset_peak`; None if unknown."""

    def memory_limit(self, device: str) -> Optional[Tuple[int, bool]]:
        """`(bytes, exact)`: the allocator's limit, and whether to trust it before an OOM."""

    def reset_peak(self, device: str) -> None:
        """Start a new peak measurement on `device` (nothing where unsupported)."""

    def conv_columns(self, model: Any, device: str) -> bool:
        """Whether `model`'s convolution gradients on `device` build a column matrix."""

    def compiles_per_shape(self, model: Any) -> bool:
        """Whether `model`'s steps compile once per piece shape (XLA)."""


class Steps(Protocol):
    """Inference steps, their traced outputs, undoing their state (module `steps`).

    A step that fails leaves the model as it was before it.

    Attributes:
        KERAS_COUNTS_EACH_BATCH_ONCE: Whether Keras's test step counts a batch once in
            per-output losses, rather than per sample.
        KERAS_BEGINS_BATCH_BEFORE_FETCH: Whether Keras's loops call `on_*_batch_begin`
            before fetching the batch (once more when a generator runs out).
    """

    KERAS_COUNTS_EACH_BATCH_ONCE: bool
    KERAS_BEGINS_BATCH_BEFORE_FETCH: bool

    def make_predict_step(self, model: Any, postprocess: Optional[Callable] = None) -> Callable:
        """A step `x -> outputs`: `model.predict_step`, then `postprocess`."""

    def make_test_step(self, model: Any, exact: bool = False) -> Callable:
        """A step `(x, y, sample_weight) -> logs`; `exact`: per-output losses per sample."""

    def prepare_test(self, model: Any, batch: Any) -> None:
        """Build `model`, its compiled metrics and loss on `batch` before test steps run."""

    def output_spec(self, step: Callable, x: Any) -> Any:
        """`step(x)`'s outputs by tracing only, arrays as `Spec`s; `NO_SPEC` if it cannot trace."""

    def guard_variables(self, variables: Sequence[Any]) -> Guard:
        """A `Guard` over `variables`."""


class Training(Protocol):
    """MemFit's train steps and gradient accumulation (module `training`)."""

    def check_training_mode(self, model: Any, mode: str) -> None:
        """Raise `NotImplementedError` where MemFit cannot train `model` in `mode` here."""

    def make_train_step(
        self, model: Any, peak_at: Optional[Callable[[int], Optional[int]]] = None
    ) -> TrainStep:
        """A `TrainStep` running Keras's default `train_step`; `peak_at(rows)`: estimated bytes."""

    def make_custom_train_step(self, model: Any, data: Any) -> TrainStep:
        """A `TrainStep` running the model's own `train_step`, made on Keras's first batch."""

    def checkpoint(self, fn: Callable) -> Callable:
        """`fn` (tensors in, tensors out) recomputed in the backward pass."""

    def make_accumulator(self, model: Any) -> Accumulator:
        """An `Accumulator` over `model`'s trainable weights."""


class KerasFunctions(Protocol):
    """Keras's step functions in the backend's calling convention (module `keras_functions`)."""

    def keras_call(self, model: Any, kind: str, *args: Any) -> "KerasCall":
        """One call of MemFit's `model.<kind>_function` by Keras (ValueError: `kind` not known)."""

    def is_end_of_data(self, exc: BaseException) -> bool:
        """Whether `exc` is how an epoch's iterator says it has no batch left."""

    def adapter_batches(self, adapter: Any) -> Iterator[Any]:
        """A Keras data adapter's batches, as Keras's loops hand them to a step."""

    def call_keras_function(
        self, model: Any, kind: str, function: Callable, batches: List[Any]
    ) -> Any:
        """Keras's own `<kind>_function` on `batches`; what it returns."""

    def materialize(self, model: Any) -> None:
        """Inside Keras's loops, write the state the steps thread into the model's variables."""


class Placement(Protocol):
    """Keeping layers on another device, for `place` (module `placement`, TensorFlow only)."""

    def device_scope(self, device: str) -> ContextManager[Any]:
        """A context placing ops and new variables on `device`."""

    def move_variable(self, variable: Any, device: str) -> bool:
        """Move a built variable's storage to `device`; whether it moved."""

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
        """The host device."""

    def list_accelerators(self) -> List[str]:
        """The canonical names of the non-host devices."""

    def canonical_device(self, name: str) -> Optional[str]:
        """`name` as the backend names its devices, or None if unparsable."""

    def device_exists(self, name: str) -> bool:
        """Whether `name` (canonical) is one of the backend's devices."""

    def variable_device(self, variable: Any) -> Optional[str]:
        """The canonical device of a Keras variable's value, or None."""


class Tracing(Protocol):
    """The model's layer calls, traced symbolically (module `tracing`), for the analysis."""

    def trace_layer_calls(self, model: Any) -> Trace:
        """Every layer and operation call of one symbolic forward pass (batch dimensions None).

        Raises:
            ValueError: If the model is not built, or makes different calls at two batch sizes.
        """


class Distribution(Protocol):
    """What the library asks about replicas, devices and processes (module `distribution`)."""

    def distribution_of(self, model: Any) -> Optional[str]:
        """The distribution `model` runs under, named for messages, or None."""

    def training_layout(self, model: Any) -> Optional[Layout]:
        """The backend's `Layout` of the batches, or None where the default one serves.

        Raises:
            NotImplementedError: For a distribution MemFit refuses.
        """

    def replica_devices(self, model: Any) -> Tuple[str, ...]:
        """The devices of `model`'s replicas when a piece is split across them; else ()."""

    def step_variant(self, model: Any) -> Hashable:
        """How a step made now for `model` runs: part of every step's cache key."""

    def piece_multiple(self) -> int:
        """What every planned piece size must be a multiple of (1: any)."""

    def evaluation(self, model: Any) -> ContextManager[None]:
        """Around `safe_evaluate`'s batches (several processes: failures posted, metrics summed)."""


class Backend(
    OutOfMemory, Memory, Steps, Training, KerasFunctions, Devices, Tracing, Distribution, Protocol
):
    """What `keras_memfit.backend.get()` returns: every concern's members."""


# ------------------------------------------------------ the seam's defaults
# A backend with nothing to do for one of these members imports it from here.
def check_training_mode(model: Any, mode: str) -> None:
    """Nothing to refuse."""


def materialize(model: Any) -> None:
    """Nothing to write: the variables hold the state."""


def evaluation(model: Any) -> ContextManager[None]:
    """Nothing around the batches."""
    return contextlib.nullcontext()


# ------------------------------------------- shared by the backends' modules
def spec_of_two_sizes(a: Any, b: Any, dtype_of: Callable[[Any], Optional[np.dtype]]) -> Any:
    """`Spec`s of outputs traced at two batch sizes: a dimension that differs is None."""

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
    """The model a step holds weakly; RuntimeError if it was deleted."""
    model = model_ref()
    if model is None:
        raise RuntimeError("the model of this step was deleted")
    return model


class KerasCall:
    """One call of MemFit's `model.<kind>_function` by Keras: its `batches`, what it `returned`."""

    def __init__(self, batches: Iterable[Any]) -> None:
        self.batches = batches

    def __enter__(self) -> "KerasCall":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        return None

    def returned(self, result: Any) -> Any:
        return result


STEP_KINDS = ("train", "test", "predict")


def check_step_kind(kind: str) -> None:
    """Raise `ValueError` unless `kind` is one of `STEP_KINDS`."""
    if kind not in STEP_KINDS:
        raise ValueError(f"kind must be one of {list(STEP_KINDS)}; received kind={kind!r}")
