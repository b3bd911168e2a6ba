"""Human-readable sizes for the tables keras_memfit prints."""

from __future__ import annotations

from typing import Optional


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
