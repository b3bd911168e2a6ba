"""Out-of-memory detection, and the error raised when running smaller cannot avoid one.

Each named predicate (as in toma) recognises one way of reporting an OOM: the forms shared
across backends here, each backend's own in `keras_memfit.backend.<name>.oom`. Anything
else is not an OOM, and keras_memfit re-raises it untouched.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Optional, Sequence, Tuple

from keras_memfit import backend as _backend

__all__ = [
    "ACCUMULATE",
    "CANNOT_SPLIT",
    "CAUSES",
    "ONE_LAYER",
    "ONE_SAMPLE",
    "OutOfMemoryError",
    "UPDATE",
    "UPDATE_BEGAN",
    "can_place",
    "can_shrink",
    "is_cuda_alloc_failure",
    "is_host_oom",
    "is_oom_error",
    "is_retryable_oom",
    "is_xla_oom",
]

# XLA (TensorFlow with jit_compile, JAX): "RESOURCE_EXHAUSTED: Out of memory
# while trying to allocate 123 bytes."
_XLA_OOM = re.compile(r"RESOURCE_EXHAUSTED:.*(out of memory|failed to allocate)", re.I | re.S)
# CUDA runtime, cuBLAS and cuDNN allocation failures, as TensorFlow and XLA
# surface them inside otherwise generic errors.
_CUDA_ALLOC = re.compile(
    r"CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_ALLOC_FAILED|CUDA_ERROR_OUT_OF_MEMORY"
    r"|cudaErrorMemoryAllocation|CUDA error: out of memory"
)


def is_host_oom(exc: BaseException) -> bool:
    """Python's own `MemoryError` (host RAM exhausted)."""
    return isinstance(exc, MemoryError)


def is_xla_oom(exc: BaseException) -> bool:
    """XLA's "RESOURCE_EXHAUSTED: Out of memory" reports."""
    return bool(_XLA_OOM.search(_message(exc)))


def is_cuda_alloc_failure(exc: BaseException) -> bool:
    """CUDA runtime, cuBLAS and cuDNN allocation failures."""
    return bool(_CUDA_ALLOC.search(_message(exc)))


def is_oom_error(exc: BaseException) -> bool:
    """Whether an exception means the device (or host) ran out of memory.

    True for the active backend's OOM forms (`keras_memfit.backend.<name>.oom`), XLA's
    "RESOURCE_EXHAUSTED: Out of memory", CUDA/cuBLAS/cuDNN allocation failures and
    `MemoryError`; False for anything else, `KeyboardInterrupt` and errors that merely
    mention memory included.

    Args:
        exc: The exception to classify.

    Returns:
        True if `exc` reports an out-of-memory condition.

    Raises:
        TypeError: If `exc` is not an exception instance.
    """
    if not isinstance(exc, BaseException):
        raise TypeError(
            "is_oom_error expects an exception instance; "
            f"received {type(exc).__name__}: {exc!r}"
        )
    if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit, ...
        return False
    return (
        isinstance(exc, _OutOfMemoryErrorBody)  # whatever the backend's message forms
        or is_host_oom(exc)
        or _backend.get().is_oom_error(exc)
        or is_xla_oom(exc)
        or is_cuda_alloc_failure(exc)
    )


def is_retryable_oom(exc: BaseException) -> bool:
    """`is_oom_error`, less keras_memfit's own `OutOfMemoryError`.

    That one is raised once an OOM was judged final, and the retry loops pass it on.
    """
    return is_oom_error(exc) and not isinstance(exc, _OutOfMemoryErrorBody)


def _message(exc: BaseException) -> str:
    message = getattr(exc, "message", None)
    return message if isinstance(message, str) else str(exc)


# What ran out of memory (`OutOfMemoryError.cause`).
ONE_SAMPLE = "one_sample"  # a piece of a single sample
ONE_LAYER = "one_layer"  # one layer's own backward pass, at a single sample
UPDATE = "update"  # the one optimizer update of a batch MemFit accumulated
ACCUMULATE = "accumulate"  # the gradient sums of a batch MemFit would accumulate
UPDATE_BEGAN = "update_began"  # a step whose optimizer update had begun
CANNOT_SPLIT = "cannot_split"  # a batch MemFit cannot split, run by Keras's own step
CAUSES = (ONE_SAMPLE, ONE_LAYER, UPDATE, ACCUMULATE, UPDATE_BEGAN, CANNOT_SPLIT)

# What an OOM in an optimizer update leaves of the weights, per backend.
_UPDATE_STATE = {
    "tensorflow": "partly updated (or lost under jit_compile, whose update works in "
                  "place on the state it was given)",
    "jax": "lost (JAX's update works in place on the state it was given)",
}
# Where a step whose optimizer update had begun ran out of memory, per backend.
_UPDATE_BEGAN_WHERE = {
    "tensorflow": ("in the update, or in the backward pass while later layers' updates ran, "
                   "as in Keras's own step"),
    "jax": ("in the update, in Keras's own step that computes the gradients and applies "
            "them as one program on the state it was given, or in the previous step's "
            "update, still running when this step began"),
    "torch": "in the update, which torch applies to the weights in place",
}
# The advice's last resorts.
_FREE = "free other models or tensors held on the device; or use a smaller model."


def can_place(model: Any) -> bool:
    """Whether `keras_memfit.place` can keep layers of `model` on the host.

    Only where the backend places layers (TensorFlow) and outside any distribution strategy.
    """
    backend = _backend.get()
    return backend.placement is not None and backend.distribution_of(model) is None


def can_shrink(model: Any) -> bool:
    """Whether `MemFit(mode="shrink")` could train `model` here."""
    try:
        _backend.get().check_training_mode(model, "shrink")
    except NotImplementedError:
        return False
    return True


class _OutOfMemoryErrorBody:
    """Raised when running smaller cannot avoid an out-of-memory error; `cause` says why.

    It subclasses the active backend's OOM error (`tf.errors.ResourceExhaustedError`,
    `jax.errors.JaxRuntimeError`, `torch.OutOfMemoryError`), so existing `except` clauses
    still catch it, and chains that error as `__cause__`. Its message says what ran out,
    whether the model is intact, and what to do next, valid on the active backend. The
    class is made on first use, so importing this module needs no backend.

    Attributes:
        model_name: Name of the model that ran out of memory.
        phase: What was running: "predict", "evaluate", "train" or "generate".
        batch_shape: Input shapes of one sample of the batch that failed.
        device: The device whose memory ran out, or None when unknown.
        cause: What ran out of memory, one of `CAUSES` (see the constants).
        rows: The rows of the batch (or step) that failed, when known.
        held: What a failed update held that grows with the batch (cause "update"),
            or None: memory that does not depend on the batch size.
        received: What a batch MemFit cannot split held (cause "cannot_split"), or None.
        stateful: The names of the model's stateful layers (cause "cannot_split"), or ().
        layer: The layer whose backward pass alone does not fit (cause "one_layer"), or None.

    The arguments are these attributes, plus `detail` (a sentence put before the
    advice), `can_place` (whether `place` may be advised; None: whether the backend
    places layers) and `can_shrink` (whether `MemFit(mode="shrink")` may be advised).

    Example:
        >>> from keras_memfit import OutOfMemoryError
        >>> try:
        ...     raise OutOfMemoryError("mlp", "predict", batch_shape=[(4,)])
        ... except OutOfMemoryError as err:
        ...     print(err.cause, err.batch_shape)
        one_sample ((4,),)
    """

    def __init__(
        self,
        model_name: str,
        phase: str,
        batch_shape: Sequence[Any] = (),
        device: Optional[str] = None,
        detail: str = "",
        cause: str = ONE_SAMPLE,
        rows: Optional[int] = None,
        held: Optional[str] = None,
        received: Optional[str] = None,
        can_place: Optional[bool] = None,
        stateful: Sequence[str] = (),
        layer: Optional[str] = None,
        can_shrink: bool = True,
    ) -> None:
        if cause not in CAUSES:
            raise ValueError(f"cause must be one of {CAUSES}; received {cause!r}")
        self.model_name = model_name
        self.phase = phase
        self.batch_shape = tuple(batch_shape)
        self.device = device
        self.detail = detail
        self.cause = cause
        self.rows = rows
        self.held = held
        self.received = received
        self.stateful = tuple(stateful)
        self.layer = layer
        self.can_place = _backend.get().placement is not None if can_place is None else can_place
        self.can_shrink = can_shrink
        parts = [self._what(), self._held(), self._state(), detail.strip(), self._advice()]
        _backend.get().init_oom_error(self, " ".join(p for p in parts if p))

    def _what(self) -> str:
        """The first sentence: what ran out of memory, on what, with its figures."""
        where = f" on {self.device}" if self.device else ""
        head = f"Model '{self.model_name}' ran out of memory in {self.phase}{where}"
        shapes = ", ".join(str(tuple(s)) for s in self.batch_shape) or "unknown"
        rows = "unknown" if self.rows is None else self.rows
        single = f"{head} even with a batch of a single sample (input shape {shapes}): "
        if self.cause == ONE_SAMPLE:
            return f"{single}one sample does not fit in the memory left on the device."
        if self.cause == ONE_LAYER:
            return (f"{single}the backward pass of layer '{self.layer}' alone needs more memory "
                    "than is free, which recomputing other layers cannot lower.")
        if self.cause == UPDATE:
            return (f"{head} in the optimizer update of a batch of {rows} rows (one sample's "
                    f"input shape {shapes}): MemFit had summed the gradients of its "
                    "micro-batches, and their one update cannot be split.")
        if self.cause == ACCUMULATE:
            return (f"{head} making room to accumulate a batch of {rows} rows (one sample's "
                    f"input shape {shapes}): the batch did not fit whole, and the sums MemFit "
                    "adds its micro-batches' gradients into, the size of the trainable "
                    "weights, do not fit either.")
        if self.cause == UPDATE_BEGAN:
            return (f"{head} once the optimizer update of a step on {rows} rows had begun "
                    f"(one sample's input shape {shapes}): {_UPDATE_BEGAN_WHERE[_backend.name()]}.")
        if self.stateful:
            names = ", ".join(f"'{name}'" for name in self.stateful)
            size = "" if self.rows is None else f" of {self.rows} rows"
            return (f"{head} on a batch{size} of a model with stateful layers "
                    f"({names}), whose batches MemFit never splits: a stateful layer "
                    "carries its state from one batch to the next at the batch size it was "
                    "built for, so the batch ran whole, as in Keras.")
        return (f"{head} on a batch that MemFit cannot split to retry it smaller, so it ran "
                "through Keras's own step, without MemFit: MemFit splits numpy arrays and "
                f"dense tensors (and None inputs). Received: {self.received}.")

    def _held(self) -> str:
        """For an update: whether its memory grows with the batch size."""
        if self.cause != UPDATE:
            return ""
        if self.held is None:
            return ("The update holds the weights, their gradients and the optimizer "
                    "slots, whose size does not depend on the batch size, so a smaller "
                    "batch_size does not help.")
        return (f"The update held {self.held}; these grow with the batch size (Keras's own "
                "step on that batch holds them too).")

    def _state(self) -> str:
        """Whether the model is intact."""
        backend = _backend.name()
        if self.cause in (UPDATE, UPDATE_BEGAN):
            lost = _UPDATE_STATE.get(backend, "partly updated")
            again = ", so MemFit does not run the batch again" if self.cause == UPDATE_BEGAN else ""
            return (f"The weights and optimizer slots may be {lost}{again}: restore them "
                    "(e.g. from a checkpoint) before training on.")
        if self.cause == CANNOT_SPLIT and backend == "jax":
            return ("Keras's JAX step donates the model's state to the step, so the OOM may "
                    "have lost it: restore the weights (e.g. from a checkpoint) before going on.")
        if self.phase == "train":
            if self.cause == CANNOT_SPLIT:
                return ("If Keras's step had begun its optimizer update, the weights and "
                        "optimizer slots may be partly updated.")
            return ("The training state is as it was before this step: save it, then resume "
                    "with `initial_epoch`.")
        return "The model's weights are unchanged."

    def _advice(self) -> str:
        """What to do next, valid on the active backend."""
        if self.cause == CANNOT_SPLIT and self.stateful:
            return ("What to do next: build the model for a smaller batch size (its inputs' "
                    f"batch_shape) and pass that batch_size; {_FREE}")
        if self.cause == CANNOT_SPLIT:
            return ("What to do next: use a smaller batch_size, or make the input dense "
                    "before it reaches the model (e.g. tf.sparse.to_dense, "
                    "RaggedTensor.to_tensor, a SciPy matrix's toarray()), so that MemFit can "
                    "split it.")
        place = (
            "keep oversized embedding/input layers (and their optimizer slots) on the CPU "
            "(`keras_memfit.place(model)`); " if self.can_place else ""
        )
        if self.cause == ONE_LAYER:
            return ("What to do next: give that layer less to hold: a smaller input (image "
                    "or sequence), fewer channels, or a stride or pooling before it; use "
                    "mixed precision (keras.mixed_precision.set_global_policy('mixed_float16'))"
                    "; free other models or tensors held on the device; or train on a device "
                    "with more memory.")
        if self.cause == ACCUMULATE:
            shrink = ("train with MemFit(mode='shrink'), which runs such a batch as smaller "
                      "batches, one optimizer update each, without these sums; or "
                      if self.can_shrink else "")
            return f"What to do next: {shrink}use a batch_size that fits whole; {place}{_FREE}"
        if self.cause in (UPDATE, UPDATE_BEGAN):
            grows = self.cause == UPDATE_BEGAN or self.held is not None
            first = "use a smaller batch_size; " if grows else ""
            rest = ("use an optimizer that keeps fewer slots per weight (SGD without momentum "
                    "keeps none, Adam two)")
        else:
            first = ("look at which layers hold the memory (`keras_memfit.memory_report("
                     "model, batch_size)`, or model.summary()); ")
            rest = ("use mixed precision (keras.mixed_precision.set_global_policy("
                    "'mixed_float16'))")
        return f"What to do next: {first}{place}{rest}; {_FREE}"

    def __reduce__(self) -> Tuple[Any, ...]:  # picklable despite the backend base's __init__
        return (
            type(self),
            (self.model_name, self.phase, self.batch_shape, self.device, self.detail,
             self.cause, self.rows, self.held, self.received, self.can_place, self.stateful,
             self.layer, self.can_shrink),
        )


if TYPE_CHECKING:
    OutOfMemoryError = _OutOfMemoryErrorBody
else:

    def __getattr__(name: str) -> Any:
        """`OutOfMemoryError`, made on first use on the active backend's OOM error bases."""
        if name == "OutOfMemoryError":
            cls = globals()["OutOfMemoryError"] = type(
                "OutOfMemoryError",
                (_OutOfMemoryErrorBody, *_backend.get().oom_error_bases()),
                {
                    "__module__": __name__,
                    "__doc__": _OutOfMemoryErrorBody.__doc__,
                },
            )
            return cls
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
