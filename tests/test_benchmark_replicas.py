"""benchmarks/replicas.py: its ratios and its RESULTS.md section, without running it.

(The run itself, `python -m benchmarks.replicas --quick`, takes a child
process with two logical CPUs and is not part of the suite.)
"""

from __future__ import annotations

import subprocess
import sys

from benchmarks import replicas
from benchmarks.common import update_section

TIMES = {
    "one_device": [4.0, 2.0, 3.0],  # median 3.0
    "two_replicas": [1.0, 2.0, 9.0],  # median 2.0
    "keras_two_replicas": [8.0, 4.0, 5.0],  # median 5.0
}


def test_ratios_are_ratios_of_medians():
    ratios = replicas.ratios(TIMES)
    assert ratios == {"two_vs_one": 2.0 / 3.0, "memfit_vs_keras": 2.0 / 5.0}


def test_section_reports_each_path_the_ratio_and_the_estimate():
    config = dict(samples=100, batch_size=10, repeats=3)
    text = replicas.section(config, {"times": TIMES}, "python -m benchmarks.replicas")
    assert "| `safe_predict`, one device (no strategy) | 3.000 (2.000-4.000) |" in text
    assert "| `safe_predict`, two replicas (MirroredStrategy) | 2.000 (1.000-9.000) |" in text
    assert "**Two replicas / one device: 0.667**" in text
    assert "both on two replicas: 0.400" in text
    assert "a reasoned estimate, not a measurement" in text
    updated = update_section("# x\n", replicas.KEY, text)
    assert "<!-- BEGIN benchmark: replicas -->" in updated and text.strip() in updated


def test_module_imports_without_tensorflow():
    code = ("import sys, benchmarks.replicas; "
            "assert 'tensorflow' not in sys.modules")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
