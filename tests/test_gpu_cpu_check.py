"""`python -m benchmarks.gpu --cpu-check`: every GPU scenario, JAX and torch, runs on the CPU first.

The GPU run (`benchmarks/gpu.py`) gets a few minutes on a lent machine,
with no time to debug there: every code path it takes runs here first, at
toy sizes under an address-space limit, and each scenario's own check
(plain Keras meets a real OOM, keras_memfit's results equal the reference,
the OOMs raise where the line says) must hold. What the scenarios measure
is printed, never asserted here.

It needs both jax and torch importable (the torch CI leg installs
`jax[cpu]` too); elsewhere it skips with that reason.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MISSING = [name for name in ("jax", "torch") if importlib.util.find_spec(name) is None]

pytestmark = pytest.mark.skipif(
    bool(MISSING),
    reason=f"{' and '.join(MISSING)} not installed for {sys.executable}: the CPU check of "
    "benchmarks/gpu.py runs both backends (the torch CI leg, with jax[cpu])",
)

SCENARIOS = {
    "jax": ("seed", "fit", "footprint", "overhead", "oom_cost", "dispatch", "donation",
            "remat"),
    "torch": ("seed", "fit", "footprint", "overhead", "oom_cost", "oom_forms", "empty_cache"),
}


def test_cpu_check_runs_every_scenario_of_both_backends(tmp_path):
    results = tmp_path / "RESULTS.md"
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu", "--cpu-check", "--results", str(results)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200,
    )
    lines = proc.stdout.splitlines()
    scenario_lines = "\n".join(line for line in lines if line.startswith(("jax ", "torch ")))
    assert proc.returncode == 0, scenario_lines + "\n" + proc.stderr[-3000:]
    for backend, names in SCENARIOS.items():
        for name in names:
            found = [line for line in lines if line.startswith(f"{backend} {name}: ")]
            assert len(found) == 1 and found[0].startswith(f"{backend} {name}: ok: "), (
                backend, name, scenario_lines)
        text = results.read_text()
        assert text.count(f"<!-- BEGIN benchmark: gpu-{backend} -->") == 1
        assert f"| {SCENARIOS[backend][-1]} | " in text
    # The questions the GPU run answers are asked here too, with an answer.
    dispatch = next(line for line in lines if line.startswith("jax dispatch: "))
    assert dispatch.count("at the wait") + dispatch.count("at the dispatch") == 2, dispatch
    donation = next(line for line in lines if line.startswith("jax donation: "))
    assert donation.count("donated input") == 2, donation
