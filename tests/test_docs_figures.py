"""The performance figures README.md and docs/ quote are benchmarks/RESULTS.md's.

RESULTS.md is the one source: each benchmark rewrites its own section there.
Two kinds of checks keep the pages from drifting from it:

- `DERIVED`: a figure the pages compute from RESULTS (a range over a table's
  ratios, a rounded extra time) must read exactly as RESULTS gives it now
  (line breaks aside);
- `FOUND`: every number in a quoted passage (a table of the pages, a
  sentence) must be one of the named RESULTS sections' numbers, at the
  precision the page gives it.

A rerun benchmark that moves a figure fails here, naming the page and the
text it should now read.
"""

from __future__ import annotations

import os
import re
from typing import Callable, Dict, List, NamedTuple

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_NUMBER = re.compile(r"(?<![\d.])\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")


def _read(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def _sections() -> Dict[str, str]:
    """RESULTS.md's sections by key (`benchmark: KEY` and `notes: KEY` alike)."""
    text = _read("benchmarks/RESULTS.md")
    found = re.findall(r"<!-- BEGIN (?:benchmark|notes): (\S+) -->(.*?)<!-- END", text, re.S)
    sections: Dict[str, str] = {}
    for key, body in found:
        sections[key] = sections.get(key, "") + body
    return sections


SECTIONS = _sections()


class Table(NamedTuple):
    heading: str  # the last heading above it
    rows: List[Dict[str, str]]  # cell text by column, `**` removed


def _tables(key: str) -> List[Table]:
    tables, heading, lines = [], "", SECTIONS[key].splitlines() + [""]
    block: List[str] = []
    for line in lines:
        if line.startswith("|"):
            block.append(line)
            continue
        if block:
            cells = [[c.strip().strip("*") for c in row.strip("|").split("|")] for row in block]
            tables.append(Table(heading, [dict(zip(cells[0], row)) for row in cells[2:]]))
            block = []
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
    return tables


def _column(key: str, heading: str, column: str, **where: str) -> List[str]:
    """The cells of `column` in the tables of section `key` whose heading holds `heading`."""
    return [
        row[column] for table in _tables(key) if heading in table.heading for row in table.rows
        if all(row.get(k) == v for k, v in where.items())
    ]


def _span(values: List[str], digits: int = 3, sep: str = "-") -> str:
    floats = sorted(float(v) for v in values)
    return f"{floats[0]:.{digits}f}{sep}{floats[-1]:.{digits}f}"


def _footprint(backends=("tensorflow", "jax", "torch")) -> List[str]:
    return [ratio for backend in backends for heading in ("trains: fit", "predicts")
            for ratio in _column(f"footprint-{backend}", heading, "ratio")]


def _overhead(key: str, calls=("predict", "evaluate")) -> List[str]:
    return [v for call in calls for v in _column(key, "", "Ratio of medians", Call=call)]


def _floor(model: str, column: str, loop: str = "model.fit + MemFit") -> str:
    [value] = _column("jax-floor", "", column, Model=model, Loop=loop)
    return value


_MEMFIT_STEP = "keras_memfit's step"  # jax-floor's loop of MemFit's step alone


def _tens(value: str) -> str:
    return f"{round(float(value), -1):.0f}"


def _own_host_time() -> str:
    [value] = [row["us"] for table in _tables("jax-floor") for row in table.rows
               if row.get("MemFit's layer, per batch", "").startswith("MemFit's own host time")]
    return value


def _interval_widths(key: str) -> str:
    """The smallest and largest width of `fit`'s 95% intervals, in points."""
    widths = [100 * (float(hi) - float(lo)) for lo, hi in
              (v.split("-") for v in _column(key, "", "95% interval", Call="fit"))]
    return f"{min(widths):.1f}-{max(widths):.1f}"


def _newest_leg_seconds() -> int:
    row = next(line for line in _read("docs/development.md").splitlines()
               if line.startswith("| `newest` |"))
    return int(row.rstrip("| ").split("|")[-1].split()[0])


class Derived(NamedTuple):
    path: str
    text: Callable[[], str]  # the text the page must hold, from RESULTS


DERIVED = [
    Derived("README.md", lambda: (
        f"is {_span(_footprint(), sep='x to ')}x of plain Keras's on the three backends, and "
        f"{max(_column('footprint-tensorflow', 'under XLA', 'ratio'))}x under XLA")),
    Derived("docs/backends.md", lambda: (
        f"is {max(float(v) for v in _column('footprint-tensorflow', 'under XLA', 'ratio')):.2f}x "
        "plain Keras's")),
    Derived("docs/backends.md", lambda: f"is {_span(_footprint(['torch']))}x plain Keras's"),
    Derived("docs/backends.md", lambda: f"take {_span(_overhead('overhead-torch'), 2)}x"),
    Derived("docs/backends.md", lambda: f"`fit` {_span(_overhead('overhead-torch', ['fit']), 2)}x"),
    Derived("docs/performance.md", lambda: (
        f"`safe_evaluate` {_span(_overhead('overhead-torch'), 2)}x of Keras")),
    Derived("docs/performance.md", lambda: (
        f"MemFit's `fit` {_span(_overhead('overhead-torch', ['fit']), 2)}x")),
    Derived("docs/performance.md", lambda: (
        f"`safe_evaluate` {_span(_overhead('overhead-jax'), 2)}x of Keras")),
    Derived("docs/performance.md", lambda: (
        f"(the digit CNN: {float(_floor('cnn', 'Ratio to its reference')):.2f}x)")),
    *[Derived(path, lambda model=model: f"about {_tens(_floor(model, 'Extra us/step'))} us")
      for path in ("docs/backends.md", "docs/performance.md") for model in ("mlp", "tiny")],
    Derived("docs/performance.md", lambda: (
        f"the wait about {_tens(_floor('tiny', 'Extra us/step', loop=_MEMFIT_STEP))} us")),
    Derived("docs/performance.md", lambda: f"MemFit's own Python about {_tens(_own_host_time())}"),
    Derived("docs/performance.md", lambda: f"span {_interval_widths('overhead-torch')} points"),
    Derived("README.md", lambda: f"took {_newest_leg_seconds():,} s on 2 CPU cores"),
]


class Found(NamedTuple):
    path: str
    start: str  # the passage: from this text ...
    end: str  # ... to this one (excluded)
    keys: tuple  # the RESULTS sections its numbers come from


_SEED = ("summary", "seed", "hostmem", "training", "scaling", "benchmarks")
FOUND = [
    Found("docs/performance.md", "| Question |", "\n\n", _SEED),
    Found("docs/performance.md", "Every OOM costs", "about 10 s", _SEED),
    Found("docs/performance.md", "which is why retrying", "and pays none", _SEED),
    Found("docs/performance.md", "| | TensorFlow | JAX |", "\n\n", ("footprint-rung",)),
    Found("docs/performance.md", "| | TensorFlow | TensorFlow, `jit_compile`", "\n\n",
          ("footprint-tensorflow", "footprint-jax", "footprint-torch")),
    Found("docs/performance.md", "adds no peak memory on TensorFlow", "call)",
          ("footprint-tensorflow",)),
    Found("docs/performance.md", "MemFit's fit 1.23x", "per batch.", ("processes",)),
    Found("docs/performance.md", "takes 100-225 us", "less", ("overhead-torch",)),
    Found("docs/performance.md", "(the 1.06,", "noise)", ("overhead-jax",)),
    Found("docs/performance.md", "The 1.17", "right after", ("overhead-torch",)),
    Found("docs/performance.md", "(mlp `fit` at batch 32", "noise", ("overhead-torch",)),
    Found("docs/backends.md", "(the 1.17", "right after)", ("overhead-torch",)),
    Found("docs/backends.md", "takes 100-225 us", "less", ("overhead-torch",)),
    Found("docs/distributed.md", "one device 1.03x", "so the", ("replicas",)),
    Found("docs/distributed.md", "multi-process fit 1.23x", "per batch (", ("processes",)),
    Found("docs/memory.md", "causal LMs 0.61-0.71x", ".\n", ("hub-report",)),
]


def _precision(number: str) -> float:
    mantissa, _, exponent = number.lower().partition("e")
    decimals = len(mantissa.partition(".")[2])
    return 0.5 * 10.0 ** (int(exponent or 0) - decimals) + 1e-12


def _value(number: str) -> float:
    return float(number.replace(",", ""))


def _numbers(keys) -> List[float]:
    return [_value(n) for key in keys for n in _NUMBER.findall(SECTIONS[key])]


@pytest.mark.parametrize("claim", DERIVED, ids=lambda c: c.path)
def test_derived_figures_read_as_results_gives_them(claim):
    text = claim.text()
    page = " ".join(_read(claim.path).split())  # as rendered: line breaks are spaces
    assert text in page, f"{claim.path} should read {text!r} (RESULTS.md now)"


@pytest.mark.parametrize("claim", FOUND, ids=lambda c: f"{c.path}:{c.start[:20]}")
def test_quoted_figures_are_in_results(claim):
    page = _read(claim.path)
    assert page.count(claim.start) == 1, f"{claim.path}: {claim.start!r} not found once"
    begin = page.index(claim.start)
    passage = page[begin:page.index(claim.end, begin + len(claim.start))]
    known = _numbers(claim.keys)
    missing = [n for n in _NUMBER.findall(passage)
               if not any(abs(_value(n) - k) <= _precision(n) for k in known)]
    assert not missing, f"{claim.path}: {missing} in {passage!r} are not in RESULTS {claim.keys}"


def test_the_checks_can_fail():
    """A figure that moved is caught by both kinds of check."""
    assert not any(abs(1.34 - k) <= _precision("1.34") for k in _numbers(["footprint-torch"]))
    assert _span(["1.004", "0.996", "1.005"]) == "0.996-1.005"
    assert "0.995x to 1.34x" not in DERIVED[0].text()
