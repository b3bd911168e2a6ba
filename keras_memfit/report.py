"""`memory_report`: where a model's memory goes, layer by layer, before it runs.

The numbers come from `keras_memfit.analysis` (one symbolic trace), which `place` shares.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import keras

from keras_memfit._internal import sequence_lengths as _lengths
from keras_memfit._internal import validate as _validate
from keras_memfit._internal.units import format_bytes
from keras_memfit.analysis import Row, analyse, short_device, sizes
from keras_memfit.analysis import report_text as _report_text
from keras_memfit.analysis.peak import DeviceMemory
from keras_memfit.training.remat import blocks

__all__ = ["DeviceMemory", "LayerMemory", "MemoryReport", "memory_report"]


@dataclasses.dataclass
class LayerMemory:
    """Memory and compute of one layer call (a row of `MemoryReport.rows`).

    Attributes:
        name: The layer's name; a layer called again has a row per call
            ("name (call 2)"), its weights counted at the first.
        class_name: The layer's (or operation's) class name.
        output_shape: Per-sample output shape (None for an unknown dimension), or a
            tuple of them for several outputs.
        params: Number of weight elements (trainable and not).
        param_bytes: Bytes of its weights.
        slot_bytes: Bytes of the optimizer slots of its trainable weights (0 without
            an optimizer).
        activation_bytes: Bytes it (and its sublayers) produce at the report's batch size.
        flops: Forward FLOPs at the report's batch size (a multiply-add counts 2; bias
            adds and activations not counted), or None where unknown.
        device: Where its variables live ("CPU:0"; several joined by ","), "-" for none.
        cut_bytes_per_sample: Bytes per sample crossing a device cut right after this
            row (tensors made at or before it, inputs included, and used after it).
        remat_bytes: Bytes recomputing in the backward pass frees at the report's
            batch size (`MemFit(remat=...)`), on the first row of each segment
            recomputed together or a nested model's row; 0 for the rest.
        remat_layers: The layers recomputed together for `remat_bytes` (0 for the rest).
    """

    name: str
    class_name: str
    output_shape: tuple
    params: int
    param_bytes: int
    slot_bytes: int
    activation_bytes: int
    flops: Optional[int]
    device: str
    cut_bytes_per_sample: int
    remat_bytes: int = 0
    remat_layers: int = 0
    # Per-sample quantities behind the estimate (not part of the table).
    activation_bytes_per_sample: int = dataclasses.field(default=0, repr=False)
    working_bytes_per_sample: int = dataclasses.field(default=0, repr=False)
    trainable_bytes: int = dataclasses.field(default=0, repr=False)

    def to_dict(self) -> Dict[str, Any]:
        """The row as a JSON-serialisable dict."""
        return json.loads(json.dumps(dataclasses.asdict(self)))  # shapes as lists


@dataclasses.dataclass(eq=False)
class MemoryReport:
    """Per-layer memory of a model at one batch size, with totals and a peak estimate.

    Built by `memory_report`. `params`, `param_bytes`, `trainable_bytes`, `slot_bytes`,
    `activation_bytes` and `flops` are the rows' totals (`flops` None if a row's is).

    Attributes:
        rows: One `LayerMemory` per layer call, in call order (nested models and
            layers with sublayers one row each); weights no call owns come last, as
            "(other weights)".
        batch_size: The batch size activations and FLOPs are given for.
        training: Whether the estimate is for a training step (else inference).
        budget: The budget in bytes given to `memory_report`, or None.
        dtype_policy: The dtype policy the bytes were counted under (None: the model's).
        input_bytes_per_sample: Bytes per sample of the model's inputs.
        device: The device the estimate is for (see `memory_report`); None for a
            model without variables.
        per_device: A `DeviceMemory` per device holding the model's variables.
        fixed_bytes: The part of `peak_bytes` that does not grow with the batch.
        bytes_per_sample: The part of `peak_bytes` per sample.
        peak_bytes: Estimated peak device memory of one step at `batch_size`,
            `fixed_bytes + batch_size * bytes_per_sample` (the formula:
            `keras_memfit.analysis.peak`). Temporaries inside a layer, allocator
            rounding and fragmentation are not modelled.
    """

    rows: List[LayerMemory]
    _: dataclasses.KW_ONLY
    model_name: str
    batch_size: int
    training: bool
    budget: Optional[int]
    dtype_policy: Optional[str]
    input_bytes_per_sample: int
    fixed_bytes: int
    bytes_per_sample: int
    device: Optional[str] = None
    per_device: Dict[str, DeviceMemory] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        rows = self.rows
        self.param_bytes = sum(r.param_bytes for r in rows)
        self.trainable_bytes = sum(r.trainable_bytes for r in rows)
        self.slot_bytes = sum(r.slot_bytes for r in rows)
        self.activation_bytes = sum(r.activation_bytes for r in rows)
        flops = [r.flops for r in rows]
        self.flops = None if any(f is None for f in flops) else sum(flops)
        self.params = sum(r.params for r in rows)
        self.per_device = dict(self.per_device or {})

    @property
    def peak_bytes(self) -> int:
        """Estimated peak device memory of one step at `batch_size`."""
        return self.peak_bytes_at(self.batch_size)

    def peak_bytes_at(self, batch_size: int, device: Optional[str] = None) -> int:
        """Estimated peak memory of one step at `batch_size` on `device` (default: the report's).

        Raises:
            ValueError: If `batch_size` is not a positive int, or `device` is not one of
                `per_device`.
        """
        batch_size = _validate.positive_int("batch_size", batch_size, allow_none=False)
        fixed, per_sample = self._estimate(device)
        return fixed + batch_size * per_sample

    def peak_bytes_on(self, device: str, batch_size: Optional[int] = None) -> int:
        """`peak_bytes_at` on `device`, at the report's `batch_size` by default."""
        return self.peak_bytes_at(self.batch_size if batch_size is None else batch_size,
                                  device=device)

    def _estimate(self, device: Optional[str]) -> Tuple[int, int]:
        """(fixed bytes, bytes per sample) of `device`, or of the report's device."""
        if device is None:
            return self.fixed_bytes, self.bytes_per_sample
        name = short_device(device)
        if name not in self.per_device:
            known = ", ".join(self.per_device) or "none: the model has no variables"
            raise ValueError(
                "device must be one of the devices the model's variables live on "
                f"({known}); received device={device!r}"
            )
        chosen = self.per_device[name]
        return chosen.fixed_bytes, chosen.bytes_per_sample

    def max_batch_size(self, budget: Optional[int] = None, device: Optional[str] = None) -> int:
        """The largest batch size whose estimated peak fits in `budget` bytes.

        Args:
            budget: Device memory in bytes; default: the report's `budget`.
            device: The device whose estimate must fit (one of `per_device`); default:
                the report's `device`.

        Returns:
            The largest `n` with `peak_bytes_at(n) <= budget`: 0 if not even one sample
            fits, `sys.maxsize` if nothing grows with the batch.

        Raises:
            ValueError: If `budget` is not a positive int (or is omitted and the report
                has none), or `device` is not one of `per_device`.
        """
        if budget is None:
            if self.budget is None:
                raise ValueError(
                    "max_batch_size needs a budget in bytes; received budget=None and "
                    "the report was made without one: pass max_batch_size(budget) or "
                    "memory_report(..., budget=...)"
                )
            budget = self.budget
        budget = _validate.positive_int("budget", budget, allow_none=False)
        fixed, per_sample = self._estimate(device)
        if budget < fixed:
            return 0
        if per_sample <= 0:
            return sys.maxsize
        return int((budget - fixed) // per_sample)

    def to_dict(self) -> Dict[str, Any]:
        """The report as a JSON-serialisable dict (rows, totals, estimate)."""
        data = {
            "model": self.model_name,
            "batch_size": self.batch_size,
            "training": self.training,
            "dtype_policy": self.dtype_policy,
            "budget": self.budget,
            "rows": [row.to_dict() for row in self.rows],
            "params": self.params,
            "param_bytes": self.param_bytes,
            "trainable_bytes": self.trainable_bytes,
            "slot_bytes": self.slot_bytes,
            "activation_bytes": self.activation_bytes,
            "flops": self.flops,
            "input_bytes_per_sample": self.input_bytes_per_sample,
            "fixed_bytes": self.fixed_bytes,
            "bytes_per_sample": self.bytes_per_sample,
            "peak_bytes": self.peak_bytes,
            "max_batch_size": (
                None if self.budget is None else self.max_batch_size(self.budget)
            ),
            "device": self.device,
            "per_device": {name: d.to_dict() for name, d in self.per_device.items()},
        }
        return json.loads(json.dumps(data))  # plain types only, checked

    def summary(
        self, print_fn: Optional[Callable[[str], Any]] = None, line_length: Optional[int] = None
    ) -> None:
        """Print the report as a table, like `model.summary()`.

        Args:
            print_fn: Called once with the whole table; default: print to stdout.
            line_length: Total width of the table; default: what its columns need.
        """
        line_length = _validate.positive_int("line_length", line_length)
        print_fn = print if print_fn is None else print_fn  # the user asked for the table
        print_fn(_report_text.table(self, line_length))

    def __str__(self) -> str:
        return _report_text.table(self, None)

    def __repr__(self) -> str:
        return (
            f"<MemoryReport {self.model_name!r} batch_size={self.batch_size} "
            f"training={self.training} peak={format_bytes(self.peak_bytes)}>"
        )


def memory_report(
    model: keras.Model,
    batch_size: int = 32,
    *,
    training: bool = True,
    dtype_policy: Any = None,
    budget: Optional[int] = None,
    device: Optional[str] = None,
    sequence_length: Optional[int] = None,
) -> MemoryReport:
    """Report where `model`'s memory goes, per layer, at `batch_size`.

    Nothing runs: the shapes come from one symbolic trace of the forward pass, so the
    model must be built (as for `model.summary()`). Operations that are not layers get
    no row (their tensors count on the row before their first consumer); unknown
    dimensions other than the batch count as 1. Optimizer slots are counted for the
    compiled optimizer without building it (docs/memory.md).

    Args:
        model: A built `keras.Model`.
        batch_size: The batch size activations, FLOPs and the estimate are given for.
        training: Estimate a training step (weights, slots, gradients and all
            activations) rather than an inference step.
        dtype_policy: Count bytes as under this dtype policy (e.g. "mixed_float16");
            default: the model's own dtypes.
        budget: Device memory in bytes; the table and `to_dict()` then give the
            largest batch size predicted to fit it.
        device: For variables on several devices, the one to estimate for ("CPU:0",
            "/GPU:0"); default: the accelerator side (of several, the one holding
            the most weight bytes).
        sequence_length: Length of the input dimensions the model leaves unknown (a
            KerasHub backbone's tokens); default: the model's `max_sequence_length`,
            else they count as 1.

    Returns:
        A `MemoryReport`; `print(report)` or `report.summary()` shows it.

    Raises:
        TypeError: If `model` is not a `keras.Model`.
        ValueError: If `batch_size` or `budget` is not a positive int, `training` is
            not a bool, `dtype_policy` is not a dtype policy, `device` holds none of
            the model's variables, or the model is not built.

    Example:
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> report = memory_report(model, batch_size=8, training=False)
        >>> report.rows[0].params, report.rows[0].output_shape
        (10, (2,))
    """
    _validate.model(model)
    batch_size = _validate.positive_int("batch_size", batch_size, allow_none=False)
    budget = _validate.positive_int("budget", budget)
    if not isinstance(training, bool):
        raise ValueError(f"training must be True or False; received training={training!r}")
    policy = sizes.dtype_policy(dtype_policy)
    if device is not None and (not isinstance(device, str) or not short_device(device)):
        raise ValueError(
            "device must be None or a device name such as 'GPU:0' or '/CPU:1'; "
            f"received device={device!r}"
        )
    sequence_length = _validate.positive_int("sequence_length", sequence_length)
    with _lengths.given(sequence_length):
        analysis = analyse(model, policy)
        frees: Dict[int, Tuple[int, int]] = {}  # id of a top-level call -> bytes, layers
        for block in blocks(model, analysis)[0]:
            saving, count = frees.get(id(block.top), (0, 0))
            frees[id(block.top)] = (saving + block.saving, count + len(block.layers))
    chosen, estimate, per_device = analysis.peak(training=training, device=device)
    return MemoryReport(
        [_layer_memory(row, batch_size, frees) for row in analysis.rows],
        model_name=model.name,
        batch_size=batch_size,
        training=training,
        budget=budget,
        dtype_policy=None if policy is None else policy.name,
        input_bytes_per_sample=analysis.input_bytes_per_sample,
        fixed_bytes=estimate.fixed_bytes,
        bytes_per_sample=estimate.bytes_per_sample,
        device=chosen,
        per_device=per_device,
    )


def _layer_memory(row: Row, batch_size: int, frees: Dict[int, Tuple[int, int]]) -> LayerMemory:
    """The table row of one analysed call at `batch_size`.

    `frees`: what recomputing frees per sample and the layers recomputed, by the id of
    the top-level call a block starts at or lies in.
    """
    saving, count = frees.pop(id(row.op), (0, 0))  # a shared layer: its first call
    return LayerMemory(
        name=row.name,
        class_name=row.class_name,
        output_shape=row.output_shape,
        params=row.params,
        param_bytes=row.param_bytes,
        slot_bytes=row.slot_bytes,
        activation_bytes=row.produced * batch_size,
        flops=None if row.flops is None else row.flops * batch_size,
        device=",".join(row.devices) if row.devices else "-",
        cut_bytes_per_sample=row.cut,
        remat_bytes=saving * batch_size,
        remat_layers=count,
        activation_bytes_per_sample=row.produced,
        working_bytes_per_sample=row.working,
        trainable_bytes=row.trainable_bytes,
    )
