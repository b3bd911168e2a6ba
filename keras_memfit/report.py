"""`memory_report`: where a model's memory goes, layer by layer, before it runs.

For each layer of a built model: its weights, the optimizer slots they bring
(for the compiled optimizer), the activations it produces at a given batch
size, its forward FLOPs where they can be derived, the device its variables
live on, and the bytes per sample that would cross between two devices if
the model were cut right after it. Totals, an estimate of the peak device
memory of one step, and the largest batch predicted to fit a memory budget
come with it. Nothing runs and nothing large is allocated: the shapes come
from one symbolic trace of the model's forward pass.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import keras

from keras_memfit import _validate
from keras_memfit import backend as _backend
from keras_memfit._units import format_bytes, format_count

__all__ = ["DeviceMemory", "LayerMemory", "MemoryReport", "memory_report"]

logger = logging.getLogger("keras_memfit")

# Training keeps the layers' outputs for the backward pass; the backward pass
# itself holds about two more activations of the largest layer at a time (the
# gradient flowing in and the one flowing out). See `MemoryReport.peak_bytes`.
_BACKWARD_WORKING_COPIES = 2
# The optimizer's update computes a few weight-sized temporaries per variable
# (and densifies sparse gradients such as an Embedding's), one variable at a time.
_UPDATE_WORKING_COPIES = 2


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
    # Per-sample quantities behind the estimate (not part of the table).
    activation_bytes_per_sample: int = dataclasses.field(default=0, repr=False)
    working_bytes_per_sample: int = dataclasses.field(default=0, repr=False)
    trainable_bytes: int = dataclasses.field(default=0, repr=False)

    def to_dict(self) -> Dict[str, Any]:
        """The row as a JSON-serialisable dict."""
        data = dataclasses.asdict(self)
        data["output_shape"] = _jsonable_shape(self.output_shape)
        return data


@dataclasses.dataclass
class DeviceMemory:
    """The peak estimate for one device of a model whose variables span several.

    Attributes:
        device: The device ("CPU:0", "GPU:0").
        param_bytes: Bytes of the weights living there.
        slot_bytes: Bytes of the optimizer slots of those weights.
        fixed_bytes: The part of the device's estimated peak that does not
            grow with the batch.
        bytes_per_sample: The part of the device's estimated peak per sample.
    """

    device: str
    param_bytes: int
    slot_bytes: int
    fixed_bytes: int
    bytes_per_sample: int

    def peak_bytes_at(self, batch_size: int) -> int:
        """`fixed_bytes + batch_size * bytes_per_sample`."""
        return self.fixed_bytes + batch_size * self.bytes_per_sample

    def to_dict(self) -> Dict[str, Any]:
        """The estimate as a JSON-serialisable dict."""
        return dataclasses.asdict(self)


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

            - inference: `fixed_bytes` = weights, plus optimizer slots when the
              optimizer is already built (they stay on the device);
              `bytes_per_sample` = the inputs (held by the caller throughout)
              plus the largest live set along the forward
              pass: for each layer, the tensors still needed after the
              previous layer (its own inputs and skip connections, i.e. the
              previous row's `cut_bytes_per_sample`) plus what the layer
              produces;
            - training: `fixed_bytes` = weights + slots + gradients (one per
              trainable weight) + two copies of the largest trainable weight
              (the optimizer update's temporaries); `bytes_per_sample` = the inputs, every
              activation (all are kept for the backward pass), plus two more
              copies of the largest one (the gradients flowing back through it).

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
        slots_resident: bool,
        largest_trainable_bytes: int = 0,
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
        activations = [r.activation_bytes_per_sample for r in rows]
        if training:
            self.fixed_bytes = (
                self.param_bytes + self.slot_bytes + self.trainable_bytes
                + _UPDATE_WORKING_COPIES * largest_trainable_bytes
            )
            self.bytes_per_sample = (
                input_bytes_per_sample
                + sum(activations)
                + _BACKWARD_WORKING_COPIES * max(activations, default=0)
            )
        else:
            self.fixed_bytes = self.param_bytes + (self.slot_bytes if slots_resident else 0)
            live, previous_cut = 0, input_bytes_per_sample
            for row in rows:
                live = max(live, previous_cut + row.working_bytes_per_sample)
                previous_cut = row.cut_bytes_per_sample
            self.bytes_per_sample = input_bytes_per_sample + live
        self.device = device
        self._spans_devices = bool(per_device) and len(per_device) > 1
        if self._spans_devices:
            chosen = per_device[device]
            self.fixed_bytes, self.bytes_per_sample = chosen.fixed_bytes, chosen.bytes_per_sample
        elif device is not None:
            per_device = {device: DeviceMemory(
                device, self.param_bytes, self.slot_bytes, self.fixed_bytes,
                self.bytes_per_sample)}
        self.per_device: Dict[str, DeviceMemory] = dict(per_device or {})

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
        name = _device_short(device)
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
            >>> from keras_memfit.demo import build_cnn
            >>> report = memory_report(build_cnn(), batch_size=512)
            >>> report.max_batch_size(400 << 20)  # training under 400 MiB
            688
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
        text = self._table(line_length)
        if print_fn is None:
            print(text)  # the user asked for the table
        else:
            print_fn(text)

    def __str__(self) -> str:
        return self._table(None)

    def __repr__(self) -> str:
        return (
            f"<MemoryReport {self.model_name!r} batch_size={self.batch_size} "
            f"training={self.training} peak={format_bytes(self.peak_bytes)}>"
        )

    def _table(self, line_length: Optional[int]) -> str:
        header = ["Layer (type)", "Output shape", "Params", "Weights", "Slots",
                  "Activations", "FLOPs", "Device", "Cut/sample"]
        body = [
            [
                f"{r.name} ({r.class_name})",
                _shape_text(r.output_shape),
                f"{r.params:,}",
                format_bytes(r.param_bytes),
                format_bytes(r.slot_bytes),
                format_bytes(r.activation_bytes),
                format_count(r.flops),
                r.device,
                format_bytes(r.cut_bytes_per_sample),
            ]
            for r in self.rows
        ]
        total = ["Total", "", f"{self.params:,}", format_bytes(self.param_bytes),
                 format_bytes(self.slot_bytes), format_bytes(self.activation_bytes),
                 format_count(self.flops), "", ""]
        widths = [max(len(line[i]) for line in [header, total] + body) for i in range(len(header))]
        natural = sum(widths) + 2 * (len(widths) - 1)
        if line_length is not None and line_length != natural:
            # Give or take room in the first two (free-text) columns.
            extra = line_length - natural
            first = max(8, widths[0] + extra // 2 + extra % 2)
            second = max(8, widths[1] + extra // 2)
            widths[0], widths[1] = first, second
        width = sum(widths) + 2 * (len(widths) - 1)

        def line(cells):
            out = []
            for i, (cell, w) in enumerate(zip(cells, widths)):
                cell = cell if len(cell) <= w else cell[: max(1, w - 1)] + "…"
                out.append(cell.ljust(w) if i < 2 or i == 7 else cell.rjust(w))
            return "  ".join(out).rstrip()

        mode = "training" if self.training else "inference"
        policy = f", dtype policy {self.dtype_policy}" if self.dtype_policy else ""
        lines = [
            f'Memory report: "{self.model_name}" ({mode}, batch_size={self.batch_size}{policy})',
            "━" * width,
            line(header),
            "━" * width,
        ]
        lines += [line(cells) for cells in body]
        lines += ["─" * width, line(total), "━" * width]
        on = f" on {self.device}" if self._spans_devices else ""
        lines.append(
            f"Estimated peak{on} at batch_size={self.batch_size}: {format_bytes(self.peak_bytes)} "
            f"({format_bytes(self.fixed_bytes)} fixed + {format_bytes(self.bytes_per_sample)} per sample)"
        )
        if self.budget is not None:
            fit = self.max_batch_size(self.budget)
            lines.append(f"Largest batch predicted to fit {format_bytes(self.budget)}{on}: {fit:,}")
        if self._spans_devices:
            lines.append(f"Per device at batch_size={self.batch_size} (memory_report(..., "
                         "device=...) for another device's estimate):")
            for name, d in self.per_device.items():
                mark = " (the estimate above)" if name == self.device else ""
                lines.append(
                    f"  {name}: {format_bytes(d.param_bytes + d.slot_bytes)} weights + slots, "
                    f"estimated peak {format_bytes(d.peak_bytes_at(self.batch_size))}{mark}"
                )
        return "\n".join(lines)


def memory_report(
    model: keras.Model,
    batch_size: int = 32,
    *,
    training: bool = True,
    dtype_policy: Any = None,
    budget: Optional[int] = None,
    device: Optional[str] = None,
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

    A model on one device is reported as before (`device`, if given, must be
    that device).

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

    Returns:
        A `MemoryReport`; `print(report)` or `report.summary()` shows it.

    Raises:
        TypeError: If `model` is not a `keras.Model`.
        ValueError: If `batch_size` or `budget` is not a positive int,
            `training` is not a bool, `dtype_policy` is not a dtype policy,
            `device` is not a device the model's variables live on, or the
            model has not been built.

    Example:
        >>> from keras_memfit.demo import build_cnn
        >>> report = memory_report(build_cnn(), batch_size=512, budget=2 << 30)
        >>> report.summary()  # the table; report.rows and report.to_dict() as data
        >>> report.rows[0].param_bytes, report.rows[0].output_shape
        (1280, (26, 26, 32))
        >>> report.max_batch_size()  # training steps predicted to fit 2 GiB
        3540
    """
    _validate.model(model)
    batch_size = _validate.positive_int("batch_size", batch_size, allow_none=False)
    budget = _validate.positive_int("budget", budget)
    if not isinstance(training, bool):
        raise ValueError(f"training must be True or False; received training={training!r}")
    policy = _policy(dtype_policy)
    if device is not None and (not isinstance(device, str) or not _device_short(device)):
        raise ValueError(
            "device must be None or a device name such as 'GPU:0' or '/CPU:1'; "
            f"received device={device!r}"
        )
    _check_built(model)
    tf_backend = _backend.get()
    trace = tf_backend.trace_layer_calls(model)

    compute_itemsize = None if policy is None else _itemsize(policy.compute_dtype)
    variable_itemsize = None if policy is None else _itemsize(policy.variable_dtype)

    def tensor_bytes(shape, dtype) -> int:
        size = 1
        for d in shape[1:]:
            size *= 1 if d is None else int(d)
        itemsize = _itemsize(dtype)
        if compute_itemsize is not None and _is_floating(dtype):
            itemsize = compute_itemsize
        return size * itemsize

    def variable_bytes(v) -> int:
        itemsize = _itemsize(v.dtype)
        if variable_itemsize is not None and _is_floating(v.dtype):
            itemsize = variable_itemsize
        return _size(v.shape) * itemsize

    sizes: Dict[str, int] = {}
    shapes: Dict[str, tuple] = {}
    for key, shape, dtype in trace["inputs"]:
        sizes[key] = tensor_bytes(shape, dtype)
        shapes[key] = shape
    calls = trace["calls"]
    for call in calls:
        for key, shape, dtype in call["inputs"] + call["outputs"]:
            sizes.setdefault(key, tensor_bytes(shape, dtype))
            shapes.setdefault(key, shape)
    children: Dict[Optional[int], List[int]] = {}
    for index, call in enumerate(calls):
        children.setdefault(call["parent"], []).append(index)
    top = children.get(None, [])

    slots = _slot_bytes(model, variable_bytes)
    input_keys = [key for key, _, _ in trace["inputs"]]
    top_cuts = _cuts(top, calls, children, sizes, input_keys)

    seen_vars: set = set()
    call_counts: Dict[int, int] = {}
    rows = []
    largest_trainable = 0
    # (device, bytes, slot bytes, trainable) of every variable, and the
    # devices of each top-level row's weights: for models on several devices.
    variables_by_device: List[Tuple[str, int, int, bool]] = []
    row_devices: List[set] = []

    def note_variables(weights) -> set:
        found = set()
        for v in weights:
            name = (tf_backend.variable_device(v) or "").lstrip("/")
            found.add(name)
            variables_by_device.append((
                name, variable_bytes(v), slots.get(id(v), 0) if v.trainable else 0,
                bool(v.trainable),
            ))
        return found - {""}

    for position, index in enumerate(top):
        call = calls[index]
        op = call["op"]
        count = call_counts[id(op)] = call_counts.get(id(op), 0) + 1
        weights = [v for v in getattr(op, "weights", []) if id(v) not in seen_vars]
        seen_vars.update(id(v) for v in weights)
        found = note_variables(weights)
        row_devices.append(found)
        trainable = [v for v in weights if v.trainable]
        largest_trainable = max([largest_trainable] + [variable_bytes(v) for v in trainable])
        produced = _produced(index, calls, children)
        activation = sum(sizes[k] for k in produced)
        devices = sorted(found)
        outputs = [shape[1:] for _, shape, _ in call["outputs"]]
        rows.append(
            LayerMemory(
                name=op.name if count == 1 else f"{op.name} (call {count})",
                class_name=type(op).__name__,
                output_shape=outputs[0] if len(outputs) == 1 else tuple(outputs),
                params=sum(_size(v.shape) for v in weights),
                param_bytes=sum(variable_bytes(v) for v in weights),
                slot_bytes=sum(slots.get(id(v), 0) for v in trainable),
                activation_bytes=activation * batch_size,
                flops=_flops_of(index, calls, children, shapes, batch_size),
                device=",".join(devices) if devices else "-",
                cut_bytes_per_sample=top_cuts[position],
                activation_bytes_per_sample=activation,
                working_bytes_per_sample=_working(index, calls, children, sizes),
                trainable_bytes=sum(variable_bytes(v) for v in trainable),
            )
        )
    # Weights no traced call owns: the model's own, or layers its call skips.
    others = [v for v in model.weights if id(v) not in seen_vars]
    if others:
        devices = sorted(note_variables(others))
        trainable = [v for v in others if v.trainable]
        largest_trainable = max([largest_trainable] + [variable_bytes(v) for v in trainable])
        rows.append(
            LayerMemory(
                name="(other weights)", class_name="-", output_shape=(),
                params=sum(_size(v.shape) for v in others),
                param_bytes=sum(variable_bytes(v) for v in others),
                slot_bytes=sum(slots.get(id(v), 0) for v in trainable),
                activation_bytes=0, flops=0,
                device=",".join(devices) if devices else "-",
                cut_bytes_per_sample=0,
                trainable_bytes=sum(variable_bytes(v) for v in trainable),
            )
        )
    optimizer = getattr(model, "optimizer", None)
    slots_resident = bool(optimizer is not None and getattr(optimizer, "built", False))
    devices = sorted({name for name, _, _, _ in variables_by_device} - {""})
    wanted = None if device is None else _device_short(device)
    if wanted is not None and devices and wanted not in devices:
        raise ValueError(
            "device must be one of the devices the model's variables live on "
            f"({', '.join(devices)}); received device={device!r}"
        )
    per_device = None
    if len(devices) > 1:
        host = tf_backend.host_device().lstrip("/")
        weight_bytes = {d: sum(b for n, b, _, _ in variables_by_device if n == d)
                        for d in devices}
        others_first = sorted(devices, key=lambda d: (d == host, -weight_bytes[d], d))
        default = others_first[0]
        sides = [next(iter(found)) if len(found) == 1 else default for found in row_devices]
        per_device = _device_estimates(
            devices, default, sides, top, calls, children, sizes, input_keys,
            variables_by_device, training=training, slots_resident=slots_resident,
        )
        wanted = wanted or default
    elif wanted is None and devices:
        wanted = devices[0]
    return MemoryReport(
        rows,
        model_name=model.name,
        batch_size=batch_size,
        training=training,
        budget=budget,
        dtype_policy=None if policy is None else policy.name,
        input_bytes_per_sample=sum(sizes[k] for k in dict.fromkeys(input_keys)),
        largest_trainable_bytes=largest_trainable,
        slots_resident=slots_resident,
        device=wanted,
        per_device=per_device,
    )


def _check_built(model: keras.Model) -> None:
    """Refuse a model whose layers are not all built: tracing would build them."""
    layers = [model] + list(model._flatten_layers(include_self=False, recursive=True))
    unbuilt = [layer.name for layer in layers if not layer.built]
    if unbuilt:
        raise ValueError(
            f"the model {model.name!r} has not been built, so its layers' shapes are "
            f"unknown; received a model with unbuilt layers {unbuilt[:5]}. Build it "
            "first, as `model.summary()` needs too: call it on a batch (a subclassed "
            "model's `build(input_shape)` builds its layers only if it defines "
            "`build`), or give a Sequential model a `keras.Input(shape)` first layer."
        )


# --------------------------------------------------------------------------
# Graph arithmetic
# --------------------------------------------------------------------------
def _produced(index: int, calls: list, children: dict) -> List[str]:
    """Keys of the tensors a call and all its descendants produce (no repeats)."""
    keys = dict.fromkeys(key for key, _, _ in calls[index]["outputs"])
    for child in children.get(index, []):
        keys.update(dict.fromkeys(_produced(child, calls, children)))
    return list(keys)


def _consumed(index: int, calls: list, children: dict) -> List[str]:
    """Keys of the tensors a call takes from outside itself (no repeats).

    Its own arguments, plus what its sublayers take that some other call
    produced (a tensor its sublayers get from an operation inside its `call`
    that is not a layer is internal to it).
    """
    keys = dict.fromkeys(key for key, _, _ in calls[index]["inputs"])
    inner = set(_produced(index, calls, children))
    produced_anywhere = _all_produced(calls)
    for child in _descendants(index, children):
        for key, _, _ in calls[child]["inputs"]:
            if key in produced_anywhere and key not in inner:
                keys[key] = None
    return [key for key in keys if key not in inner]


def _descendants(index: int, children: dict) -> List[int]:
    found = []
    for child in children.get(index, []):
        found.append(child)
        found.extend(_descendants(child, children))
    return found


def _all_produced(calls: list) -> set:
    return {key for call in calls for key, _, _ in call["outputs"]}


def _cuts(
    sequence: Sequence[int], calls: list, children: dict, sizes: dict, entering: Sequence[str]
) -> List[int]:
    """Bytes per sample crossing a cut after each call of `sequence`.

    Tensors in `entering` (the model's inputs, or a nested call's inputs) are
    produced before the first call; a tensor nobody in `sequence` produced is
    taken as produced right before its first consumer.

    Returns:
        The cut after each call.
    """
    produced_at: Dict[str, int] = {key: -1 for key in entering}
    last_use: Dict[str, int] = {}
    for position, index in enumerate(sequence):
        for key in _consumed(index, calls, children):
            if key not in produced_at:
                produced_at[key] = position - 1
            last_use[key] = max(last_use.get(key, -1), position)
        for key in _produced(index, calls, children):
            produced_at.setdefault(key, position)
    cuts = []
    for position in range(len(sequence)):
        cuts.append(sum(
            sizes.get(key, 0) for key, used in last_use.items()
            if used > position and produced_at[key] <= position
        ))
    return cuts


def _working(index: int, calls: list, children: dict, sizes: dict) -> int:
    """Bytes per sample a call holds at its busiest, beyond the tensors it was given.

    A leaf call: what it produces. A call with sublayers: the largest, over its
    sublayers in order, of what crosses into that sublayer from before plus
    that sublayer's own working bytes (its inputs from outside are counted by
    the caller).
    """
    inner = children.get(index, [])
    own = sum(sizes.get(key, 0) for key, _, _ in calls[index]["outputs"])
    if not inner:
        return own
    entering = [key for key, _, _ in calls[index]["inputs"]]
    cuts = _cuts(inner, calls, children, sizes, entering)
    live, previous = 0, 0
    for position, child in enumerate(inner):
        live = max(live, previous + _working(child, calls, children, sizes))
        previous = cuts[position]
    return max(live, own)


def _device_estimates(
    devices: Sequence[str],
    default: str,
    sides: Sequence[str],
    top: Sequence[int],
    calls: list,
    children: dict,
    sizes: dict,
    input_keys: Sequence[str],
    variables: Sequence[Tuple[str, int, int, bool]],
    *,
    training: bool,
    slots_resident: bool,
) -> Dict[str, DeviceMemory]:
    """The peak estimate of each device, for a model whose variables span several.

    `sides[i]` is the device top-level call `top[i]` runs on. A tensor lives
    on the device of the call producing it and on that of every top-level
    call consuming it (a model input: on its consumers' devices, or on
    `default`). Per device, the same arithmetic as `MemoryReport` with the
    tensors and variables living there; on one device it gives the same
    numbers.
    """
    residence: Dict[str, set] = {}
    for position, index in enumerate(top):
        for key in _produced(index, calls, children):
            residence.setdefault(key, set()).add(sides[position])
    for position, index in enumerate(top):
        for key in _consumed(index, calls, children):
            residence.setdefault(key, set()).add(sides[position])
    estimates = {}
    for device in devices:
        here = {key: (size if device in residence.get(key, {default}) else 0)
                for key, size in sizes.items()}
        inputs = sum(here.get(key, 0) for key in dict.fromkeys(input_keys))
        mine = [(b, s, t) for name, b, s, t in variables if (name or default) == device]
        params = sum(b for b, _, _ in mine)
        slot_bytes = sum(s for _, s, _ in mine)
        trainable = [b for b, _, t in mine if t]
        produced = [sum(here[key] for key in _produced(index, calls, children)) for index in top]
        if training:
            fixed = params + slot_bytes + sum(trainable) + \
                _UPDATE_WORKING_COPIES * max(trainable, default=0)
            per_sample = inputs + sum(produced) + \
                _BACKWARD_WORKING_COPIES * max(produced, default=0)
        else:
            fixed = params + (slot_bytes if slots_resident else 0)
            cuts = _cuts(top, calls, children, here, input_keys)
            live, previous_cut = 0, inputs
            for position, index in enumerate(top):
                working = (_working(index, calls, children, sizes)
                           if sides[position] == device else produced[position])
                live = max(live, previous_cut + working)
                previous_cut = cuts[position]
            per_sample = inputs + live
        estimates[device] = DeviceMemory(device, params, slot_bytes, fixed, per_sample)
    return estimates


# --------------------------------------------------------------------------
# Optimizer slots
# --------------------------------------------------------------------------
class _SlotStandIn:
    """What the recording optimizer copy gets instead of a slot variable."""

    def __init__(self, shape, dtype):
        self.shape = tuple(shape)
        self.dtype = dtype


def _slot_bytes(model: keras.Model, variable_bytes: Callable[[Any], int]) -> Dict[int, int]:
    """Slot bytes per trainable variable (by `id`) for the model's optimizer."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return {}
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None:  # LossScaleOptimizer: its own variables are scalars
        optimizer = inner
    trainable = list(model.trainable_variables)
    if not trainable:
        return {}
    by_ref: Dict[int, int] = {}
    pooled = 0
    try:
        clone = type(optimizer).from_config(optimizer.get_config())

        def from_reference(reference_variable, name=None, initializer="zeros"):
            nonlocal by_ref
            stand_in = _SlotStandIn(reference_variable.shape, reference_variable.dtype)
            by_ref[id(reference_variable)] = by_ref.get(id(reference_variable), 0) + \
                variable_bytes(stand_in)
            return stand_in

        def add_variable(shape, initializer="zeros", dtype=None, aggregation="none",
                         layout=None, name=None, **kwargs):
            nonlocal pooled
            stand_in = _SlotStandIn(shape, dtype or "float32")
            pooled += variable_bytes(stand_in)
            return stand_in

        object.__setattr__(clone, "add_variable_from_reference", from_reference)
        object.__setattr__(clone, "add_variable", add_variable)
        clone.build(trainable)
    except Exception as exc:  # a custom optimizer that cannot be copied this way
        by_ref, pooled = {}, 0
        if not getattr(optimizer, "built", False):
            logger.warning(
                "memory_report: could not count the slots of %s (%s: %s); they are "
                "reported as 0 until the optimizer is built", type(optimizer).__name__,
                type(exc).__name__, exc)
            return {}
        pooled = sum(
            variable_bytes(v) for v in optimizer.variables if _size(v.shape) > 1
        )
    if pooled:  # slots not tied to one variable: shared in proportion to size
        total = sum(variable_bytes(v) for v in trainable) or 1
        for v in trainable:
            by_ref[id(v)] = by_ref.get(id(v), 0) + round(pooled * variable_bytes(v) / total)
    return by_ref


# --------------------------------------------------------------------------
# FLOPs
# --------------------------------------------------------------------------
_ZERO_FLOP_LAYERS = (
    "InputLayer", "Flatten", "Reshape", "Permute", "RepeatVector", "Dropout",
    "SpatialDropout1D", "SpatialDropout2D", "SpatialDropout3D", "GaussianDropout",
    "GaussianNoise", "AlphaDropout", "Concatenate", "Identity", "Embedding",
    "ZeroPadding1D", "ZeroPadding2D", "ZeroPadding3D", "Cropping1D", "Cropping2D",
    "Cropping3D", "ActivityRegularization", "Masking",
)
_MERGE_LAYERS = ("Add", "Subtract", "Multiply", "Average", "Maximum", "Minimum")
_ELEMENTWISE_LAYERS = ("Activation", "ReLU", "LeakyReLU", "ELU", "PReLU", "Softmax")


def _flops_of(
    index: int, calls: list, children: dict, shapes: dict, batch_size: int
) -> Optional[int]:
    per_sample = _layer_flops(calls[index], shapes)
    if per_sample is not None:
        return per_sample * batch_size
    inner = children.get(index, [])
    if not inner:
        return None
    parts = [_flops_of(child, calls, children, shapes, batch_size) for child in inner]
    return None if any(p is None for p in parts) else sum(parts)


def _layer_flops(call: dict, shapes: dict) -> Optional[int]:
    """Forward FLOPs per sample of a layer of a known kind, or None."""
    from keras.src.layers.convolutional.base_conv import BaseConv
    from keras.src.layers.convolutional.base_conv_transpose import BaseConvTranspose
    from keras.src.layers.convolutional.base_depthwise_conv import BaseDepthwiseConv
    from keras.src.layers.convolutional.base_separable_conv import BaseSeparableConv
    from keras.src.layers.pooling.base_global_pooling import BaseGlobalPooling
    from keras.src.layers.pooling.base_pooling import BasePooling

    layer = call["op"]
    outputs = [shape[1:] for _, shape, _ in call["outputs"]]
    if not outputs or any(None in shape for shape in outputs):
        return None
    out = outputs[0]
    out_size = _size(out)
    name = type(layer).__name__
    if name in _ZERO_FLOP_LAYERS:
        return 0
    kernel = getattr(layer, "kernel", None)
    channels_first = getattr(layer, "data_format", None) == "channels_first"
    spatial = (out[1:] if channels_first else out[:-1]) if len(out) > 1 else ()
    if isinstance(layer, keras.layers.Dense):
        if kernel is None:
            return None
        fan_in, units = int(kernel.shape[0]), int(kernel.shape[1])
        return 2 * fan_in * units * _size(out[:-1])
    if isinstance(layer, BaseDepthwiseConv):
        return 2 * _size(layer.kernel_size) * out_size
    if isinstance(layer, BaseSeparableConv):
        depthwise = layer.depthwise_kernel
        in_channels = int(depthwise.shape[-2]) * int(depthwise.shape[-1])
        return 2 * _size(spatial) * in_channels * (_size(layer.kernel_size) + layer.filters)
    if isinstance(layer, BaseConvTranspose):
        if kernel is None:
            return None
        # kernel: (*kernel_size, filters, in_channels); every input position
        # spreads into kernel_size x filters outputs.
        in_channels, filters = int(kernel.shape[-1]), int(kernel.shape[-2])
        stride = _size(layer.strides)
        in_positions = _size(spatial) // max(1, stride)
        return 2 * _size(layer.kernel_size) * in_channels * filters * in_positions
    if isinstance(layer, BaseConv):
        if kernel is None:
            return None
        # kernel: (*kernel_size, in_channels / groups, filters)
        per_output = _size(layer.kernel_size) * int(kernel.shape[-2])
        return 2 * per_output * out_size
    if isinstance(layer, BaseGlobalPooling):
        shape = call["inputs"][0][1] if call["inputs"] else None
        return None if shape is None or None in shape[1:] else _size(shape[1:])
    if isinstance(layer, BasePooling):
        return _size(layer.pool_size) * out_size
    if name in _MERGE_LAYERS:
        return max(0, len(call["inputs"]) - 1) * out_size
    if name in _ELEMENTWISE_LAYERS:
        return out_size
    if name == "BatchNormalization":
        return 2 * out_size
    return None


# --------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------
def _policy(value: Any):
    if value is None:
        return None
    try:
        return keras.dtype_policies.get(value)
    except (ValueError, TypeError) as exc:
        raise ValueError(
            "dtype_policy must be None, a dtype policy name such as 'mixed_float16' "
            f"or a keras.DTypePolicy; received dtype_policy={value!r} ({exc})"
        ) from None


def _device_short(name: str) -> str:
    """A device name in short form ("/device:GPU:0", "/GPU:0" -> "GPU:0"); "" if unparsable."""
    name = name.rsplit("device:", 1)[-1].strip().lstrip("/")
    kind, _, index = name.partition(":")
    if not kind or not kind.isalpha() or (index and not index.isdigit()):
        return ""
    return f"{kind.upper()}:{int(index) if index else 0}"


def _size(shape: Sequence[Optional[int]]) -> int:
    size = 1
    for d in shape:
        size *= 1 if d is None else int(d)
    return size


def _dtype_name(dtype: Any) -> str:
    return getattr(dtype, "name", None) or str(dtype)


def _itemsize(dtype: Any) -> int:
    name = _dtype_name(dtype)
    if name == "bool":
        return 1
    bits = re.findall(r"\d+", name)
    return max(1, int(bits[-1]) // 8) if bits else 4


def _is_floating(dtype: Any) -> bool:
    return "float" in _dtype_name(dtype)


def _jsonable_shape(shape: Any) -> Any:
    if isinstance(shape, tuple):
        return [_jsonable_shape(s) for s in shape]
    return shape


def _shape_text(shape: tuple) -> str:
    if shape and isinstance(shape[0], tuple):
        return ", ".join(_shape_text(s) for s in shape)
    if len(shape) == 1:
        return f"({'?' if shape[0] is None else shape[0]},)"
    return "(" + ", ".join("?" if d is None else str(d) for d in shape) + ")"
