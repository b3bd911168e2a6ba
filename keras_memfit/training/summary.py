"""MemFit's record of a call: the end-of-call summary line and History's entries."""

from __future__ import annotations

from collections import Counter
from typing import Any, Dict, List, Tuple

import keras

PHASES = ("train", "evaluate", "predict")
# MemFit's entries in the epoch logs, and their value for an epoch with no adaptation.
EPOCH_ENTRIES = {"memfit_ooms": 0, "memfit_split": 1, "memfit_remat": 0}


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def summary(
    call: str,
    model_name: str,
    events: List[Dict[str, Any]],
    most_pieces: Dict[str, Tuple[int, int]],
) -> str:
    """One line saying what MemFit adapted during `call` (`most_pieces`: `Run.most_pieces`)."""
    parts = []
    ooms = Counter(e["phase"] for e in events if e["kind"] == "oom")
    if ooms:
        by_phase = ", ".join(f"{p} {ooms[p]}" for p in PHASES if ooms[p])
        parts.append(f"{_count(sum(ooms.values()), 'OOM')} caught ({by_phase})")
    for phase in PHASES:
        if phase in most_pieces:
            pieces, rows = most_pieces[phase]
            parts.append(f"{phase} batches of {rows} rows run as up to {pieces} pieces")
    remat = [e for e in events if e["kind"] == "remat"]
    if remat:
        parts.append(f"{_count(len(remat[-1]['layers']), 'layer')} recomputed in the backward pass")
    for kind, word in (("grow", "growth"), ("estimate", "estimate")):
        n = sum(1 for e in events if e["kind"] == kind)
        if n:
            parts.append(_count(n, word))
    return (
        f"MemFit: {call} on model '{model_name}' adapted: " + "; ".join(parts)
        + f"; details in MemFit.events ({_count(len(events), 'event')})."
    )


def pad_history(history: Any) -> None:
    """Give a `keras.callbacks.History` MemFit's entries for the earlier epochs."""
    if not isinstance(history, keras.callbacks.History) or not history.history:
        return
    lengths = [len(values) for key, values in history.history.items() if key not in EPOCH_ENTRIES]
    epochs = max(lengths, default=0)
    for key, value in EPOCH_ENTRIES.items():
        values = history.history.setdefault(key, [])
        values.extend([value] * (epochs - len(values)))
