"""Human-readable sizes, counts, shapes and tables for what keras_memfit prints."""

from __future__ import annotations

from typing import List, Optional, Sequence


def format_bytes(n: Optional[int]) -> str:
    """`1536` -> "1.5 KiB", `12` -> "12 B", None -> "?" (binary units up to TiB)."""
    if n is None:
        return "?"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover


def format_count(n: Optional[int]) -> str:
    """`1_500_000` -> "1.5M", `999` -> "999", None -> "?" (decimal K, M, G, T)."""
    if n is None:
        return "?"
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def format_shape(shape: tuple) -> str:
    """`(26, 26, 32)` -> "(26, 26, 32)", `(None, 8)` -> "(?, 8)"; several shapes joined by ", "."""
    if shape and isinstance(shape[0], tuple):
        return ", ".join(format_shape(s) for s in shape)
    dims = ", ".join("?" if d is None else str(d) for d in shape)
    return f"({dims},)" if len(shape) == 1 else f"({dims})"


def format_table(
    title: str,
    header: Sequence[str],
    body: Sequence[Sequence[str]],
    total: Sequence[str],
    *,
    line_length: Optional[int] = None,
    left: Sequence[int] = (0, 1),
) -> List[str]:
    """A ruled text table's lines; the first two columns stretch or shrink to `line_length`."""
    widths = [max(len(row[i]) for row in [header, total, *body]) for i in range(len(header))]
    natural = sum(widths) + 2 * (len(widths) - 1)
    if line_length is not None and line_length != natural:
        extra = line_length - natural
        widths[0] = max(8, widths[0] + extra // 2 + extra % 2)
        widths[1] = max(8, widths[1] + extra // 2)
    width = sum(widths) + 2 * (len(widths) - 1)

    def line(cells):
        out = []
        for i, (cell, w) in enumerate(zip(cells, widths)):
            cell = cell if len(cell) <= w else cell[: max(1, w - 1)] + "…"
            out.append(cell.ljust(w) if i in left else cell.rjust(w))
        return "  ".join(out).rstrip()

    return [title, "━" * width, line(header), "━" * width, *(line(cells) for cells in body),
            "─" * width, line(total), "━" * width]
