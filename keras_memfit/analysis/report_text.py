"""The text table of a `MemoryReport` (its `summary()` and `str`)."""

from __future__ import annotations

from typing import Any, Optional

from keras_memfit._internal.units import format_bytes, format_count, format_shape, format_table


def table(report: Any, line_length: Optional[int]) -> str:
    """The text table `MemoryReport.summary()` prints (`line_length` None: its natural width)."""
    header = ["Layer (type)", "Output shape", "Params", "Weights", "Slots",
              "Activations", "Remat frees", "FLOPs", "Device", "Cut/sample"]
    body = [
        [
            f"{r.name} ({r.class_name})",
            format_shape(r.output_shape),
            f"{r.params:,}",
            format_bytes(r.param_bytes),
            format_bytes(r.slot_bytes),
            format_bytes(r.activation_bytes),
            _remat(r.remat_bytes, r.remat_layers),
            format_count(r.flops),
            r.device,
            format_bytes(r.cut_bytes_per_sample),
        ]
        for r in report.rows
    ]
    total = ["Total", "", f"{report.params:,}", format_bytes(report.param_bytes),
             format_bytes(report.slot_bytes), format_bytes(report.activation_bytes), "",
             format_count(report.flops), "", ""]
    mode = "training" if report.training else "inference"
    policy = f", dtype policy {report.dtype_policy}" if report.dtype_policy else ""
    title = f'Memory report: "{report.model_name}" ({mode}, batch_size={report.batch_size}{policy})'
    lines = format_table(title, header, body, total, line_length=line_length, left=(0, 1, 8))
    on = f" on {report.device}" if len(report.per_device) > 1 else ""
    lines.append(
        f"Estimated peak{on} at batch_size={report.batch_size}: {format_bytes(report.peak_bytes)} "
        f"({format_bytes(report.fixed_bytes)} fixed + {format_bytes(report.bytes_per_sample)} per sample)"
    )
    if report.budget is not None:
        fit = report.max_batch_size(report.budget)
        lines.append(f"Largest batch predicted to fit {format_bytes(report.budget)}{on}: {fit:,}")
    if len(report.per_device) > 1:
        lines.append(f"Per device at batch_size={report.batch_size} (memory_report(..., "
                     "device=...) for another device's estimate):")
        for name, d in report.per_device.items():
            mark = " (the estimate above)" if name == report.device else ""
            lines.append(
                f"  {name}: {format_bytes(d.param_bytes + d.slot_bytes)} weights + slots, "
                f"estimated peak {format_bytes(d.peak_bytes_at(report.batch_size))}{mark}"
            )
    return "\n".join(lines)


def _remat(saving: int, layers: int) -> str:
    """A "Remat frees" cell: the bytes and the layers recomputed together, or "-"."""
    if not saving:
        return "-"
    return f"{format_bytes(saving)} ({layers} layer{'' if layers == 1 else 's'})"
