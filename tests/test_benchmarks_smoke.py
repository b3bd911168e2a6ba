"""Smoke tests: the benchmarks run end to end in their quick mode, and report honestly.

Only that they run, check their own work and report is tested here.
Performance claims are measured by `python -m benchmarks.run` and recorded in
benchmarks/RESULTS.md, never asserted in a timed unit test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO_RESULTS = os.path.join(ROOT, "benchmarks", "RESULTS.md")
SCENARIOS = ("overhead", "seed", "hostmem", "training", "scaling")

sys.path.insert(0, ROOT)
try:
    from benchmarks import plot, report
    from benchmarks.common import write_section
finally:
    sys.path.remove(ROOT)


def _mtime(path):
    return os.path.getmtime(path) if os.path.exists(path) else None


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    before = _mtime(REPO_RESULTS)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--output", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=400,
    )
    return proc, out, before


@pytest.mark.tensorflow(reason="benchmarks.run measures on TensorFlow (its capped allocator) by default; it runs in the TensorFlow legs")
def test_quick_run_writes_every_section_the_plot_and_raw_results(quick_run):
    proc, out, before = quick_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out / "results.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    data = json.loads((out / "results.json").read_text())
    assert set(SCENARIOS) <= set(data)
    text = (out / "RESULTS.md").read_text()
    for key in ("summary",) + SCENARIOS:
        assert text.count(f"<!-- BEGIN benchmark: {key} -->") == 1, key
        assert text.count(f"<!-- END benchmark: {key} -->") == 1, key
    # The summary comes before every scenario section, after the file's header.
    assert text.index("<!-- BEGIN benchmark: summary -->") < text.index(
        "<!-- BEGIN benchmark: overhead -->")
    assert text.startswith("# keras_memfit benchmarks")
    # Every target has a verdict in the summary.
    for figure in ("safe_predict vs model.predict", "safe_evaluate vs model.evaluate",
                   "fit with MemFit() vs plain fit", "safe_predict, 1st call vs oracle",
                   "safe_predict, 2nd call vs oracle", "postprocess=argmax",
                   "out=np.memmap"):
        assert figure in text, figure
    # --output was given: the committed RESULTS.md is left alone.
    assert _mtime(REPO_RESULTS) == before


@pytest.mark.tensorflow(reason="benchmarks.run measures on TensorFlow (its capped allocator) by default; it runs in the TensorFlow legs")
def test_quick_run_checks_every_approach_against_the_reference(quick_run):
    proc, out, _ = quick_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "results.json").read_text())
    seed_runs = data["seed"]["runs"]
    assert {r["approach"] for r in seed_runs} == {
        "oracle", "safe", "halving", "decay", "finder", "manual_split"}
    # The oracle writes the reference; every other approach's predictions were compared.
    assert all(r.get("checked") for r in seed_runs if r["approach"] != "oracle")
    # Training: MemFit without memory pressure trains exactly like plain fit.
    losses = {r["approach"]: r["final_loss"] for r in data["training"]["runs"]}
    assert losses["memfit"] == pytest.approx(losses["uncapped"], rel=1e-5)
    steps = {r["approach"]: r["optimizer_steps"] for r in data["training"]["runs"]}
    n, batch = data["training"]["n"], data["training"]["batch_size"]
    assert steps["memfit"] == steps["uncapped"] == -(-n // batch)  # one epoch in --quick
    # Scaling: uncapped, the probe at the largest size runs, so every approach runs there.
    scaling = data["scaling"]
    assert [(p["n"], p["ok"]) for p in scaling["probes"]] == [(512, True)]
    assert {p["approach"] for p in scaling["samples"] if p["n"] == 512} == {
        "oracle", "safe", "halving"}
    # Host memory: the output's size is the hand-computed one.
    hm = data["hostmem"]
    assert hm["output_bytes"] == hm["n"] * hm["width"] * 4


def test_report_only_regenerates_sections_and_keeps_notes(tmp_path):
    """--report-only on a copy regenerates from results.json and keeps notes."""
    (tmp_path / "results.json").write_text(json.dumps(_fake_results()))
    notes = "<!-- BEGIN notes: mine -->\nhand-written\n<!-- END notes: mine -->\n"
    (tmp_path / "RESULTS.md").write_text("# keras_memfit benchmarks\n\nintro\n\n" + notes)
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--report-only", "--no-plot",
         "--output", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = (tmp_path / "RESULTS.md").read_text()
    assert "hand-written" in text
    assert text.index("intro") < text.index("<!-- BEGIN benchmark: summary -->")
    assert "<!-- BEGIN benchmark: seed -->" in text


def _fake_results():
    """Hand-made raw results with known ratios (seed: safe 12 s, oracle 10 s, halving 60 s)."""
    def run(approach, seconds, **extra):
        return dict(approach=approach, seconds=seconds, cpu_seconds=seconds / 2, ooms=0,
                    batch_size=100, n=1000, **extra)

    return {
        "machine": {"CPU": "test"},
        "seed": dict(
            date="d", command="c", n=1000, requested=1000, cap_mb=400, oracle_batch=100,
            smallest_failed=128, repeats_note="r",
            runs=[run("oracle", 10.0), run("oracle", 11.0), run("oracle", 9.0),
                  run("safe", 12.0, second_seconds=10.4, second_cpu_seconds=5.2, second_ooms=0,
                      second_batch_size=90, first_sizes=[16, 64, 90]),
                  run("safe", 14.0, second_seconds=10.6, second_cpu_seconds=5.3, second_ooms=0,
                      second_batch_size=90, first_sizes=[16, 64, 90]),
                  run("halving", 60.0)],
        ),
        "hostmem": dict(
            date="d", command="c", n=1000, width=10, batch_size=10, repeats=1,
            output_bytes=40000,
            runs=[dict(approach="safe_argmax", added_bytes=2000, added_share=0.05,
                       hwm_added_bytes=2000, seconds=1.0),
                  dict(approach="safe_memmap", added_bytes=8000, added_share=0.2,
                       hwm_added_bytes=9000, seconds=1.0)],
        ),
    }


def test_summary_ratios_and_verdicts_match_hand_computed_values():
    rows = {r["figure"]: r for r in report.summary_rows(_fake_results())}
    first = rows["safe_predict, 1st call vs oracle"]
    # median(safe) = 13, median(oracle) = 10: 1.3 is within "<= 1.3".
    assert first["value"] == pytest.approx(1.3) and first["ok"] is True
    assert first["ratio"].startswith("1.300 (CPU time: 1.300)")
    second = rows["safe_predict, 2nd call vs oracle"]
    assert second["value"] == pytest.approx(1.05) and second["ok"] is True  # 10.5 / 10
    ahead = [r for f, r in rows.items() if f.startswith("safe_predict, 1st call vs the fastest")]
    assert ahead[0]["value"] == pytest.approx(13 / 60) and ahead[0]["ok"] is True
    assert rows["safe_predict(postprocess=argmax): peak added memory / output size"]["ok"]
    memmap = rows["safe_predict(out=np.memmap): peak added memory / output size"]
    assert memmap["value"] == pytest.approx(0.2) and memmap["ok"] is False  # over 10%
    assert "**MISS**" in report.summary_markdown(_fake_results())


def test_scaling_reports_a_failed_probe_as_a_failure_not_a_time(tmp_path):
    """Where model.predict cannot run at all, its approaches show the failure, never a time."""
    results = _fake_results()

    def point(approach, n, seconds, ooms=0):
        return dict(approach=approach, n=n, seconds=seconds, ooms=ooms, batch_size=100)

    probe = dict(ok=False, n=100000, batch_size=32, seconds=21.6,
                 error="ResourceExhaustedError", detail="OOM when allocating tensor")
    results["scaling"] = dict(
        date="d", command="c", approaches=["oracle", "safe", "halving"], cap_mb=400,
        oracle_batch=100, overshoot_n=500, overshoot_oracle_seconds=2.0, probes=[probe],
        samples=[point("oracle", 500, 2.0), point("safe", 500, 2.5),
                 point("halving", 500, 20.0, ooms=2), point("safe", 100000, 30.0)],
        overshoot=[dict(point("safe", 500, 2.5), factor=1, requested=100),
                   dict(point("halving", 500, 2.0), factor=1, requested=100)],
    )
    text = report.scaling_markdown(results)
    rows = {line.split(" | ")[0]: line.split(" | ")[1:] for line in text.splitlines()
            if line.startswith("| 1") or line.startswith("| 500")}
    # Columns: oracle, safe_predict, halving. 1,000 is the seed's (oracle median of 10/11/9).
    assert rows["| 1,000"][0] == "10.0 s (0 OOM)"
    assert rows["| 100,000"][1] == "30.0 s (0 OOM)"
    assert rows["| 100,000"][0].startswith("*fails*")
    assert rows["| 100,000"][2].startswith("*fails*")
    assert "`ResourceExhaustedError` after 21.6 s" in text
    assert "batch_size=32" in text and "OOM when allocating tensor" in text
    # The plot draws the failure without a time (it would raise on a missing "seconds").
    plot.write_plot(str(tmp_path / "results.png"), results)
    assert (tmp_path / "results.png").read_bytes()[:4] == b"\x89PNG"


def test_overhead_section_is_replaced_in_place(tmp_path):
    """Regenerating a section keeps other sections of RESULTS.md intact."""
    path = tmp_path / "RESULTS.md"
    write_section(str(path), "overhead", "## A\nfirst")
    write_section(str(path), "other", "## B\nkept")
    write_section(str(path), "overhead", "## A\nsecond")
    text = path.read_text()
    assert "second" in text and "first" not in text
    assert "kept" in text
    assert text.count("<!-- BEGIN benchmark: overhead -->") == 1
    assert text.index("## A") < text.index("## B")
    assert text.startswith("# keras_memfit benchmarks")  # a new file gets the header


BENCHMARK_MODULES = (
    "common", "jobs", "hostmem", "seed", "training", "report", "plot", "overhead", "run",
    "replicas", "gpu", "gpu_child", "gpu_common", "gpu_jax", "gpu_torch",
)


def _imports_of(module):
    """The `benchmarks.*` modules `benchmarks/MODULE.py` imports (top level or in functions)."""
    import ast

    with open(os.path.join(ROOT, "benchmarks", f"{module}.py")) as f:
        tree = ast.parse(f.read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "benchmarks":
                found.update(alias.name for alias in node.names)
            elif node.module.startswith("benchmarks."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names
                         if a.name.startswith("benchmarks."))
    return found - {module}


def test_benchmark_imports_have_no_cycle_and_no_private_app_helpers():
    graph = {m: _imports_of(m) for m in BENCHMARK_MODULES}
    assert graph["common"] == set()  # the shared module imports no scenario
    assert "overhead" not in graph["report"] and "report" not in graph["overhead"]

    def reach(start, seen):
        for nxt in graph.get(start, ()):
            assert nxt != seen[0], f"import cycle through benchmarks.{nxt}: {seen}"
            if nxt not in seen:
                reach(nxt, seen + [nxt])

    for module in BENCHMARK_MODULES:
        reach(module, [module])
    for module in BENCHMARK_MODULES:  # the app only through its public modules
        with open(os.path.join(ROOT, "benchmarks", f"{module}.py")) as f:
            text = f.read()
        assert "keras_memfit._" not in text and "keras_memfit.app._" not in text, module
        assert "keras_memfit.demo" not in text and "keras_memfit._child" not in text, module


def test_each_benchmark_module_imports_alone_without_tensorflow():
    code = (
        "import importlib, sys; importlib.import_module(sys.argv[1]); "
        "assert 'tensorflow' not in sys.modules, sys.argv[1]"
    )
    for module in BENCHMARK_MODULES:
        proc = subprocess.run(
            [sys.executable, "-c", code, f"benchmarks.{module}"],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )
        assert proc.returncode == 0, (module, proc.stderr[-2000:])
