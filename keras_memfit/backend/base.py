"""The backend seam's contract: what every backend package provides, typed.

keras_memfit's core (planning batch sizes, splitting batches, retrying,
MemFit's strategies, the model analysis) is backend-neutral. Everything that
depends on Keras's backend is a function of one package,
`keras_memfit.backend.<name>`, whose `__init__` exports the names of the
`Backend` protocol below; `keras_memfit.backend.get()` returns the active
one. A new backend is a new package with the same module names
(`oom`, `memory`, `steps`, `training`, `trainer`, `devices`, `tracing`) that
satisfies this protocol; nothing outside `keras_memfit/backend/` changes.

The values that cross the seam are typed here too: a traced output's `Spec`
(or `NO_SPEC`), a model's symbolic `Trace` (`TracedCall`, `TracedTensor`), a
train step's `StepOutcome`, and the `TrainStep` (with the optional
`StartableTrainStep` and `OrderedTrainStep`), `Accumulator` and `Guard`
objects the step factories return.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import (
    Any,
    Callable,
    ContextManager,
    Dict,
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

    def add(self, data: Any, weight: float) -> None:
        """Add `weight` times the gradient of the loss on micro-batch `data`."""

    def apply(self) -> None:
        """Apply the summed gradients as one optimizer step."""

    def held(self) -> Optional[str]:
        """What the last `apply` held that grows with the batch, in words; None: only sums.

        For the message of an OOM in the update: None when it held sums the
        size of the weights (memory that does not depend on the batch size).
        """


class Backend(Protocol):
    """What a backend package exports (see each backend's modules for details).

    Grouped by the module that implements each part in every backend.
    """

    # oom: the backend's own out-of-memory forms.
    def is_oom_error(self, exc: BaseException) -> bool: ...
    def oom_error_bases(self) -> Tuple[type, ...]: ...
    def init_oom_error(self, err: BaseException, message: str) -> None: ...

    # memory: statistics and limits for the planner.
    def compute_device(self) -> str: ...
    # The devices of the model's replicas when each piece is split across
    # several (tf.distribute); () when it runs on `compute_device()`.
    def replica_devices(self, model: Any) -> Tuple[str, ...]: ...
    def memory_stats(self, device: str) -> Optional[Tuple[int, int]]: ...
    def memory_limit(self, device: str) -> Optional[Tuple[int, bool]]: ...
    def reset_peak(self, device: str) -> None: ...
    # What every planned piece size must be a multiple of (the devices a
    # batch is laid out over, e.g. JAX's DataParallel); 1 for any size.
    def piece_multiple(self) -> int: ...
    # Whether the model's steps compile once per piece shape (XLA: JAX unless
    # run eagerly, TensorFlow with jit_compile): each new size then costs a
    # compilation, so the planner avoids probe sizes and keeps few shapes.
    def compiles_per_shape(self, model: Any) -> bool: ...

    # steps: compiled inference steps, their outputs, undoing their state.
    # Whether Keras's own test step counts each batch once in per-output losses
    # (a step traced with an unknown batch size), rather than per sample.
    KERAS_COUNTS_EACH_BATCH_ONCE: bool
    # Whether Keras's predict/evaluate loops call `on_*_batch_begin` before
    # fetching the batch (TensorFlow, JAX: once more, for a batch that never
    # came, when a generator runs out) or after (torch). Optional: a backend
    # without it counts as True.
    KERAS_BEGINS_BATCH_BEFORE_FETCH: bool

    def make_predict_step(self, model: Any, postprocess: Optional[Callable] = None) -> Callable: ...
    def make_test_step(self, model: Any, exact: bool = False) -> Callable: ...
    def prepare_test(self, model: Any, batch: Any) -> None: ...
    def output_spec(self, step: Callable, x: Any) -> Any: ...
    def guard_variables(self, variables: Sequence[Any]) -> Guard: ...
    # The distribution `model` runs under, named for messages
    # ("tf.distribute.MirroredStrategy", "keras.distribution.DataParallel"),
    # or None: a question only, refusing nothing.
    def distribution_of(self, model: Any) -> Optional[str]: ...

    # training: train steps that can tell how far they got, accumulation.
    def has_default_train_step(self, model: Any) -> bool: ...
    # The one answer to "may MemFit train under the current distribution, and
    # how": the replicas whose rows MemFit splits alike (a tf.distribute
    # strategy), None where batches are split whole (no distribution, JAX's
    # single-process DataParallel); NotImplementedError, naming what was
    # received, for a distribution MemFit refuses.
    def training_replicas(self, model: Any) -> Optional[Any]: ...
    # How many processes train together, each on its own rows (JAX's
    # multi-controller runtime, `jax.distributed`); 1 elsewhere. Above 1 every
    # batch is one agreement of every process, so each batch must be one
    # update (MemFit's accumulation).
    def process_count(self) -> int: ...
    # After a standalone evaluate: with several processes, replace each
    # process's metric state (its own rows') by the sum over the processes
    # (one agreement, one sum), as Keras's multi-process evaluate reports;
    # nothing with one process.
    def combine_process_metrics(self, model: Any) -> None: ...
    # A call that ends in an agreement (safe_evaluate) failed in this process
    # with `exc`: tell the other processes, so that they stop at once.
    def process_failed(self, exc: BaseException) -> None: ...
    def make_train_step(self, model: Any) -> TrainStep: ...
    # A model's own train_step, made ready as Keras makes its own on `data`,
    # Keras's first batch (TensorFlow traces it there, which builds the model).
    def make_custom_train_step(self, model: Any, data: Any) -> TrainStep: ...
    def make_accumulator(self, model: Any) -> Accumulator: ...

    # trainer: Keras's step functions in this backend's calling convention.
    def step_function(
        self, model: Any, kind: str, run_batches: Callable[[List[Any]], Any]
    ) -> Callable: ...
    def is_end_of_data(self, exc: BaseException) -> bool: ...
    # The batches of a Keras data adapter in the form Keras's loops give steps.
    def adapter_batches(self, adapter: Any) -> Iterator[Any]: ...
    # Keras's own step function (saved before MemFit installed its own) on
    # batches MemFit passes through unsplit.
    def call_keras_function(
        self, model: Any, kind: str, function: Callable, batches: List[Any]
    ) -> Any: ...
    # Inside Keras's loops, put the state the backend threads through its steps
    # into the model's variables, so that an eager call of the model reads it
    # (JAX; elsewhere the variables always hold it: nothing to do).
    def materialize(self, model: Any) -> None: ...

    # devices: naming devices and placing variables and calls (`place`).
    # Whether `place` can keep layers on another device (False: the five
    # placement functions below raise NotImplementedError).
    PLACES_LAYERS: bool
    def host_device(self) -> str: ...
    def list_accelerators(self) -> List[str]: ...
    def canonical_device(self, name: str) -> Optional[str]: ...
    def device_exists(self, name: str) -> bool: ...
    def device_scope(self, device: str) -> ContextManager[Any]: ...
    def variable_device(self, variable: Any) -> Optional[str]: ...
    def move_variable(self, variable: Any, device: str) -> bool: ...
    def creating_on(self, device: str, add_weight: Callable) -> Callable: ...
    def call_on_device(self, device: str, call: Callable) -> Callable: ...
    def follow_variable_devices(self, optimizer: Any) -> None: ...

    # tracing: the model's layer calls, symbolically (the model analysis).
    def trace_layer_calls(self, model: Any) -> Trace: ...
