"""Smoke test: the overhead benchmark runs end to end in its quick mode.

Only that it runs and reports ratios is checked. Performance claims are
measured by `python -m benchmarks.overhead` and recorded in
benchmarks/RESULTS.md, never asserted in a timed unit test.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO_RESULTS = os.path.join(ROOT, "benchmarks", "RESULTS.md")


def _mtime(path):
    return os.path.getmtime(path) if os.path.exists(path) else None


def test_overhead_benchmark_quick_runs_and_prints_ratios(tmp_path):
    results = tmp_path / "RESULTS.md"
    before = _mtime(REPO_RESULTS)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.overhead", "--quick", "--output", str(results)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ratios = re.findall(
        r"^ratio (\w+) (predict|evaluate|fit) batch=\d+: (\d+\.\d+)", proc.stdout,
        re.MULTILINE,
    )
    calls = {call for _, call, _ in ratios}
    assert calls == {"predict", "evaluate", "fit"}, proc.stdout[-3000:]
    assert all(float(value) > 0 for _, _, value in ratios)
    assert "| Ratio of medians |" in proc.stdout
    # --quick writes nothing unless --write is given.
    assert not results.exists()
    assert _mtime(REPO_RESULTS) == before


def test_overhead_benchmark_section_is_replaced_in_place(tmp_path):
    """Regenerating a section keeps other sections of RESULTS.md intact."""
    sys.path.insert(0, ROOT)
    try:
        from benchmarks.overhead import update_section
    finally:
        sys.path.remove(ROOT)
    path = tmp_path / "RESULTS.md"
    update_section(str(path), "overhead", "## A\nfirst")
    update_section(str(path), "other", "## B\nkept")
    update_section(str(path), "overhead", "## A\nsecond")
    text = path.read_text()
    assert "second" in text and "first" not in text
    assert "kept" in text
    assert text.count("<!-- BEGIN benchmark: overhead -->") == 1
    assert text.index("## A") < text.index("## B")
