"""Cutting a sequence of calls into segments to recompute in the backward pass.

Segment `s`'s backward pass holds what segments up to `s` keep plus what `s` makes inside.
"""

from __future__ import annotations

from typing import Collection, List, Optional, Sequence, Tuple

import numpy as np


def cut(tensors: Sequence[Sequence[Tuple[int, int]]],
        alone: Collection[int] = ()) -> List[Tuple[int, int, int]]:
    """Segments `(start, stop, frees)` of positions 0..n-1, the lowest peak once all recomputed.

    `tensors[p]`: (bytes, last use; n or more: alive to the end) of each tensor made at `p`;
    `alone`: positions that are a segment each; `frees`: bytes made inside, unused after it.
    """
    n = len(tensors)  # 0: the loops below find no segment
    made = np.zeros((n, n + 1))  # made[p, t]: bytes made at p whose last use is t
    for p, produced in enumerate(tensors):
        for size, last in produced:
            made[p, min(max(last, p), n)] += size
    # inside[a, b]: bytes made at a..b that nothing after b uses (a <= b).
    inside = np.cumsum(np.cumsum(made[:, :n], axis=1)[::-1], axis=0)[::-1]
    total = np.concatenate([np.cumsum(made.sum(axis=1)[::-1])[::-1], [0.0]])
    kept = total[:, None][:n] - total[None, 1:] - inside  # kept[a, b]: made at a..b, used after b
    allowed = np.triu(np.ones((n, n), dtype=bool))
    for p in alone:
        allowed[:p + 1, p:] = False
        allowed[p, p] = True
    low, high = 0.0, float(total[0])
    best = _feasible(inside, kept, allowed, high)
    while high - low > max(1.0, high * 1e-4):  # the smallest peak, by bisection
        middle = (low + high) / 2
        found = _feasible(inside, kept, allowed, middle)
        if found is None:
            low = middle
        else:
            high, best = middle, found
    segments = []
    stop = n
    while stop:
        start = best[stop]
        segments.append((start, stop, int(inside[start, stop - 1])))
        stop = start
    return segments[::-1]


def _feasible(inside: np.ndarray, kept: np.ndarray, allowed: np.ndarray,
              peak: float) -> Optional[List[int]]:
    """Each segment's start (by its stop) keeping the fewest bytes within `peak`, or None."""
    n = len(inside)
    held = np.full(n + 1, np.inf)  # held[i]: fewest bytes kept by segments covering 0..i-1
    held[0] = 0.0
    starts = [0] * (n + 1)
    for b in range(n):
        keep = held[:b + 1] + kept[:b + 1, b]
        ok = allowed[:b + 1, b] & (keep + inside[:b + 1, b] <= peak)
        if ok.any():
            a = int(np.argmin(np.where(ok, keep, np.inf)))
            held[b + 1], starts[b + 1] = keep[a], a
    return starts if np.isfinite(held[n]) else None
