"""`memory_report`: where a model's memory goes, layer by layer, before it runs.

For each layer of a built model: its weights, the optimizer slots they bring
(for the compiled optimizer), the activations it produces at a given batch
size, its forward FLOPs where they can be derived, the device its variables
live on, and the bytes per sample that would cross between two devices if
the model were cut right after it. Totals, an estimate of the peak device
memory of one step, and the largest batch predicted to fit a memory budget
come with it. Nothing runs and nothing large is allocated: the shapes come
from one symbolic trace of the model's forward pass.

This module is the public front end: the numbers come from
`keras_memfit.analysis` (the traced graph, the byte and slot counters, the
peak formula), which `keras_memfit.place` shares.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import keras

from keras_memfit._internal import lengths as _lengths
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
        name: The layer's name (a layer called more than once has one row per
            call, named `"name (call 2)"` and so on, with its weights counted
            at its first call only).
        class_name: The layer's (or operation's) class name.
        output_shape: Per-sample shape of its output (no batch dimension;
            None for an unknown dimension), or a tuple of such shapes for
            several outputs.
        params: Number of weight elements (trainable and not).
        param_bytes: Bytes of its weights.
        slot_bytes: Bytes of the optimizer slots kept for its trainable
            weights (0 when the model has no optimizer).
        activation_bytes: Bytes of the tensors it produces at the report's
            batch size (for a nested model or a layer with sublayers: its
            sublayers' outputs too).
        flops: Forward floating-point operations at the report's batch size
            (a multiply-add counts as 2; bias adds and activations are not
            counted), or None where they cannot be derived.
        device: Where its variables live ("CPU:0", "GPU:0"; several joined by
            ","), or "-" when it has none.
        remat_bytes: Bytes recomputing in the backward pass would free at
            the report's batch size (MemFit's rung after splitting,
            `MemFit(remat=...)`), on the first call of each segment MemFit
            recomputes together (what the segment makes that nothing after
            it uses), or on a nested model's row for its own segments; 0 for
            the rest.
        remat_layers: The layers recomputed together for `remat_bytes` (0 for
            the rest).
        cut_bytes_per_sample: Bytes per sample that would cross the device
            boundary if everything up to and including this row ran on one
            device and the rest on another: every tensor produced at or before
            it (model inputs included) and consumed after it.
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
        data = dataclasses.asdict(self)
        data["output_shape"] = _jsonable_shape(self.output_shape)
        return data


class MemoryReport:
    """Per-layer memory of a model at one batch size, with totals and an estimate of peak.

    Built by `memory_report`; see there for the arguments.

    Attributes:
        rows: One `LayerMemory` per layer call of the model's forward pass, in
            call order. Nested models and layers with sublayers are one row
            each (their sublayers' weights, activations and FLOPs included).
            Weights that no call owns (a subclassed model's own weights, a
            layer its `call` skips) come last, as a row named
            `"(other weights)"`.
        batch_size: The batch size activations and FLOPs are given for.
        training: Whether the estimate is for a training step (else inference).
        budget: The memory budget given to `memory_report` (bytes), or None.
        dtype_policy: Name of the dtype policy the bytes were computed under,
            or None for the model's own dtypes.
        input_bytes_per_sample: Bytes per sample of the model's inputs.
        param_bytes: Total bytes of all weights.
        trainable_bytes: Total bytes of the trainable weights (the size of
            their gradients).
        slot_bytes: Total bytes of the optimizer's slots.
        activation_bytes: Total bytes of all activations at `batch_size`.
        flops: Total forward FLOPs at `batch_size`, or None if some layer's
            are unknown.
        device: The device the estimate (`fixed_bytes`, `bytes_per_sample`,
            `peak_bytes`, `max_batch_size`) is for: the one the model's
            variables live on, or, when they span several, the `device`
            given to `memory_report` or by default the accelerator side (see
            `memory_report`). None for a model without variables.
        per_device: A `DeviceMemory` per device the model's variables live on
            (one entry for a model on one device, with the same numbers as
            the report).
        fixed_bytes: The part of `peak_bytes` that does not grow with the batch.
        bytes_per_sample: The part of `peak_bytes` per sample.
        peak_bytes: Estimated peak device memory of one step at `batch_size`:
            `fixed_bytes + batch_size * bytes_per_sample`, where

            - inference: `fixed_bytes` = weights, plus the slots of a built
              optimizer; `bytes_per_sample` = the inputs plus the largest live
              set along the forward pass (each layer's output plus what the
              previous row's `cut_bytes_per_sample` keeps alive);
            - training: `fixed_bytes` = weights + slots + gradients + two
              update temporaries of the largest trainable weight;
              `bytes_per_sample` = the inputs, every activation (kept for the
              backward pass) and two more copies of the largest one.

            Not modelled: temporaries inside a layer (convolution workspaces,
            the tensors between a Dense's matmul, bias add and activation),
            allocator rounding and fragmentation. Compared with the peak
            measured by TensorFlow's allocator the estimate is within the error
            stated in the README (measured by `tests/test_report.py`).
    """


    def __init__(
        self,
        rows: List[LayerMemory],
        *,
        model_name: str,
        batch_size: int,
        training: bool,
        budget: Optional[int],
        dtype_policy: Optional[str],
        input_bytes_per_sample: int,
        fixed_bytes: int,
        bytes_per_sample: int,
        device: Optional[str] = None,
        per_device: Optional[Dict[str, DeviceMemory]] = None,
    ) -> None:
        self.rows = rows
        self.model_name = model_name
        self.batch_size = batch_size
        self.training = training
        self.budget = budget
        self.dtype_policy = dtype_policy
        self.input_bytes_per_sample = input_bytes_per_sample
        self.param_bytes = sum(r.param_bytes for r in rows)
        self.trainable_bytes = sum(r.trainable_bytes for r in rows)
        self.slot_bytes = sum(r.slot_bytes for r in rows)
        self.activation_bytes = sum(r.activation_bytes for r in rows)
        flops = [r.flops for r in rows]
        self.flops = None if any(f is None for f in flops) else sum(flops)
        self.params = sum(r.params for r in rows)
        self.fixed_bytes = fixed_bytes
        self.bytes_per_sample = bytes_per_sample
        self.device = device
        self.per_device: Dict[str, DeviceMemory] = dict(per_device or {})
        self._spans_devices = len(self.per_device) > 1

    @property
    def peak_bytes(self) -> int:
        """Estimated peak device memory of one step at `batch_size` (see the class)."""
        return self.peak_bytes_at(self.batch_size)

    def peak_bytes_at(self, batch_size: int, device: Optional[str] = None) -> int:
        """Estimated peak device memory of one step at another batch size.

        Args:
            batch_size: A positive batch size.
            device: The device to estimate for (one of `per_device`, e.g.
                "CPU:0" or "/GPU:0"); defaults to the report's `device`.

        Returns:
            `fixed_bytes + batch_size * bytes_per_sample` (of that device).

        Raises:
            ValueError: If `batch_size` is not a positive int, or `device` is
                not one the model's variables live on.
        """
        batch_size = _validate.positive_int("batch_size", batch_size, allow_none=False)
        fixed, per_sample = self._estimate(device)
        return fixed + batch_size * per_sample

    def peak_bytes_on(self, device: str, batch_size: Optional[int] = None) -> int:
        """Estimated peak memory of one step on `device`.

        Args:
            device: One of the devices in `per_device` ("CPU:0", "/CPU:0"...).
            batch_size: Defaults to the report's `batch_size`.

        Returns:
            The device's `fixed_bytes + batch_size * bytes_per_sample`.

        Raises:
            ValueError: If `device` is not one the model's variables live on,
                or `batch_size` is not a positive int.
        """
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
            budget: Device memory in bytes; defaults to the report's `budget`.
            device: The device whose estimate must fit (one of `per_device`);
                defaults to the report's `device`.

        Returns:
            The largest `n` with `peak_bytes_at(n) <= budget`; 0 if not even one
            sample fits (for instance when the weights alone exceed it);
            `sys.maxsize` if nothing grows with the batch.

        Raises:
            ValueError: If `budget` is not a positive int, or is omitted when the
                report was made without one, or `device` is not one the
                model's variables live on.

        Example:
            >>> report = memory_report(model, batch_size=512)  # the MLP of `memory_report`
            >>> report.max_batch_size(16 << 20)  # training under 16 MiB
            1907
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
        """The report as a JSON-serialisable dict (rows, totals, estimate).

        Returns:
            A dict of plain Python values (`json.dumps` accepts it).
        """
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
            print_fn: Called once with the whole table (a string of lines), as
                `model.summary` does; defaults to printing to stdout.
            line_length: Total width of the table; defaults to what its
                columns need.

        Raises:
            ValueError: If `line_length` is not a positive int or None.
        """
        line_length = _validate.positive_int("line_length", line_length)
        text = _report_text.table(self, line_length)
        if print_fn is None:
            print(text)  # the user asked for the table
        else:
            print_fn(text)

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

    The shapes come from one symbolic trace of the model's forward pass
    (`training=False`, nothing runs, no variable changes), so it works for
    Sequential, functional and subclassed models alike. The model must be
    built, as `model.summary()` requires: a subclassed model must have been
    called on data or built with `model.build(input_shape)`. Operations
    inside a layer's `call` that are not layers (e.g. `x + 1` in a subclassed
    model) get no row; a tensor they produce is counted as produced by the row
    before its first consumer. Unknown dimensions other than the batch count
    as 1.

    Models on several devices (after `keras_memfit.place`): when the
    model's variables live on more than one device, the peak estimate is for
    one device: `device` if given, else the accelerator side, i.e. the device
    other than the host `/CPU:0` (of several, the one holding the most weight
    bytes), where the compute-heavy layers live; the table says which
    ("Estimated peak on GPU:0 ...") and its footer lists every device's
    weights + slots and estimated peak (`report.per_device`). The rule:

    - a weight, its optimizer slots, its gradient and its update temporaries
      count on the device the weight lives on;
    - each top-level row runs on the device of its weights; a row without
      weights (or with weights on several devices) runs on the accelerator
      side, as `place` runs the model's own ops there;
    - a tensor counts on the device of the row that produces it, and also on
      the device of every row that consumes it: the tensors crossing the cut
      (a host embedding's output) thus land on the accelerator too; a model
      input counts on each device that consumes it.

    Optimizer slots are counted for the compiled optimizer (a
    `LossScaleOptimizer` is looked through) without building it: a copy made
    from its config builds against the model's weights while recording the
    shapes of the slots it asks for, and allocates none of them.

    Args:
        model: A built `keras.Model`.
        batch_size: The batch size activations, FLOPs and the peak estimate are
            given for.
        training: Estimate a training step (weights, slots, gradients and all
            activations) rather than an inference step.
        dtype_policy: Count bytes as if the model ran under this dtype policy
            (e.g. `"mixed_float16"`: floating activations in float16,
            floating variables and slots in float32). Default: the dtypes the
            model has.
        budget: Device memory in bytes; when given, the report's table and
            `to_dict()` include the largest batch size predicted to fit it.
        device: For a model whose variables span several devices, the device
            to estimate the peak for ("CPU:0", "/GPU:0"); default: the
            accelerator side (see above).
        sequence_length: The length of input dimensions (after the batch's)
            the model leaves unknown, such as a KerasHub backbone's tokens
            (`token_ids` of shape `(batch, None)`). Default: the model's
            `max_sequence_length` (KerasHub backbones and tasks), else they
            stay unknown and count as 1.

    Returns:
        A `MemoryReport`; `print(report)` or `report.summary()` shows it.

    Raises:
        TypeError: If `model` is not a `keras.Model`.
        ValueError: If `batch_size` or `budget` is not a positive int,
            `training` is not a bool, `dtype_policy` is not a dtype policy,
            `device` is not a device the model's variables live on, or the
            model has not been built.

    Example:
        >>> model = keras.Sequential([
        ...     keras.Input((784,)),
        ...     keras.layers.Dense(256, activation="relu", name="hidden"),
        ...     keras.layers.Dense(10, activation="softmax", name="out"),
        ... ])
        >>> model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        >>> report = memory_report(model, batch_size=512, budget=64 << 20)
        >>> report.summary()  # the table; report.rows and report.to_dict() as data
        >>> report.rows[0].param_bytes, report.rows[0].output_shape
        (803840, (256,))
        >>> report.max_batch_size()  # training steps predicted to fit 64 MiB
        9962
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
    """The table row of one analysed call, its activations and FLOPs at `batch_size`
    (`frees`: what recomputing frees per sample and the layers recomputed, by the
    id of the top-level call a block starts at or lies in)."""
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


def _jsonable_shape(shape: Any) -> Any:
    if isinstance(shape, tuple):
        return [_jsonable_shape(s) for s in shape]
    return shape
