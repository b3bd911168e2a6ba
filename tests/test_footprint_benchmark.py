"""Smoke tests of `benchmarks/footprint.py`: it runs in its quick mode and measures honestly.

Each backend's quick run (a fresh subprocess: fit and peak at batch 8, 25%
resolution, a small limit) must write its section with plausible numbers,
and its bisections must pass their own checks: monotonic, both ends tried,
plain Keras really out of memory just above its widest width. The checks
themselves are tested on doctored results (a broken measurement must fail
them) and the bisection on a known threshold. The one-sample rung's part
(`--parts seq`, TensorFlow, toy size) must climb the rung: MemFit trains a
sequence longer than plain Keras's longest by recomputing blocks. What the benchmark measures
is recorded in benchmarks/RESULTS.md, never asserted here.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.jax_support import requires_jax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
try:
    from benchmarks import footprint, footprint_report
finally:
    sys.path.remove(ROOT)

requires_tensorflow = pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None
    or os.environ.get("KERAS_BACKEND", "tensorflow") != "tensorflow",
    reason="the TensorFlow quick run (about 150 s of real OOMs) runs in the TensorFlow "
    "legs; tensorflow is not installed here, or the suite runs on another backend")


def _quick(tmp_path, backend, *args):
    output, data = tmp_path / "RESULTS.md", tmp_path / "footprint.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.footprint", "--backend", backend, "--quick",
         "--output", str(output), "--json", str(data), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return output.read_text(), json.loads(data.read_text())[backend]


def _check_quick_run(tmp_path, backend):
    text, data = _quick(tmp_path, backend)
    assert text.count(f"<!-- BEGIN benchmark: footprint-{backend} -->") == 1
    assert "### Widest model that trains: fit" in text
    fit = data["parts"]["fit"]
    plain, mine = fit["8/plain"], fit["8/memfit"]
    for result, reference in ((plain, True), (mine, False)):
        assert footprint.check_widest(result, reference) == []
        assert result["widest"] > 0 and result["failed"] > result["widest"]
    # The plain reference really ran out of memory just above its widest width.
    failure = [t for t in plain["tries"] if t["width"] == plain["failed"]][0]
    assert failure["oom"] and not failure["ok"]
    ratio = mine["widest"] / plain["widest"]
    assert 0.2 < ratio < 2.0
    assert f"**{ratio:.3f}**" in text
    peak = data["parts"]["peak"]
    if peak["available"]:
        for run in peak["runs"]["plain"] + peak["runs"]["memfit"]:
            # The fit holds at least the weights, Adam's two slots and the gradients.
            assert run["peak"] >= run["added"] > 0
    else:
        assert "not available on JAX's CPU client" in text
    return data


@requires_tensorflow
def test_quick_run_on_tensorflow_writes_a_checked_section(tmp_path):
    data = _check_quick_run(tmp_path, "tensorflow")
    assert data["parts"]["peak"]["available"]  # the BFC allocator's statistics


@requires_jax
def test_quick_run_on_jax_writes_a_checked_section(tmp_path):
    _check_quick_run(tmp_path, "jax")


def _known(threshold, oom=True):
    """A try that trains up to `threshold`, recording each width asked for."""
    asked = []

    def trains(width):
        asked.append(width)
        return {"ok": width <= threshold, "oom": oom and width > threshold}
    return trains, asked


@pytest.mark.parametrize("lo, hi", [(1000, 2000), (2000, 4000), (100, 1200)])
def test_bisection_finds_a_known_threshold_even_outside_its_bracket(lo, hi):
    trains, asked = _known(1500)
    result = footprint.widest(trains, lo, hi, 0.01)
    assert result["widest"] <= 1500 < result["failed"]
    assert result["failed"] - result["widest"] <= max(footprint.STEP, 0.01 * result["widest"])
    assert footprint.check_widest(result, reference=True) == []
    assert len(asked) == len(set(asked)) <= 14  # no width tried twice


def test_a_width_that_fails_once_is_tried_again_before_it_counts_as_failing():
    """A threshold at 1500 whose every width fails its first try (a non-sharp edge):
    with one try the bisection's answer is wrong; with two it is the threshold."""
    def flaky(threshold):
        seen = set()

        def trains(width):
            first = width not in seen
            seen.add(width)
            ok = width <= threshold and not first
            return {"ok": ok, "oom": not ok}
        return trains

    once = footprint.widest(flaky(1500), 1000, 2000, 0.01)
    assert once["widest"] < 1000  # every first try failed: the answer is wrong
    twice = footprint.widest(flaky(1500), 1000, 2000, 0.01, confirm=2)
    assert twice["widest"] <= 1500 < twice["failed"]
    assert twice["failed"] - twice["widest"] <= max(footprint.STEP, 0.01 * twice["widest"])
    assert footprint.check_widest(twice, reference=True) == []
    assert {t["width"] for t in twice["tries"] if not t["ok"]} >= {twice["widest"]}


def test_a_broken_measurement_fails_the_checks():
    trains, _ = _known(1500)
    good = footprint.widest(trains, 1000, 2000, 0.01)
    # Not monotonic: a wider try that trained.
    broken = copy.deepcopy(good)
    broken["tries"].append({"width": good["failed"] + 400, "ok": True})
    assert any("not monotonic" in p for p in footprint.check_widest(broken, True))
    # The reference failed above its widest without running out of memory.
    trains, _ = _known(1500, oom=False)
    no_oom = footprint.widest(trains, 1000, 2000, 0.01)
    assert any("without an OOM" in p for p in footprint.check_widest(no_oom, True))
    assert footprint.check_widest(no_oom, reference=False) == []  # keras_memfit may fail so
    # A reported widest width that was never tried, and a bracket too wide.
    broken = dict(copy.deepcopy(good), widest=good["widest"] - 200)
    problems = footprint.check_widest(broken, True)
    assert any("was not tried" in p for p in problems)
    assert any("wider than the resolution" in p for p in problems)
    # The report flags every problem as an invalid measurement.
    data = {"parts": {"fit": {"8/plain": dict(broken, problems=problems)},
                      "compiles": {"toy": 3}}}
    assert len(footprint_report.problems(data)) == len(problems) + 1


@pytest.mark.parametrize("module", ["footprint", "footprint_child", "footprint_report"])
def test_footprint_modules_import_alone_without_keras(module):
    """The child sets its address-space limit before jax starts: nothing heavy at the top."""
    code = ("import importlib, sys; importlib.import_module(sys.argv[1]); "
            "assert not {'tensorflow', 'keras', 'jax'} & set(sys.modules), sys.argv[1]")
    proc = subprocess.run([sys.executable, "-c", code, f"benchmarks.{module}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
