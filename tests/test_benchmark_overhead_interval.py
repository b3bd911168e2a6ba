"""The overhead benchmark's interval around each ratio, its verdicts, and its sections rebuilt from saved timings.

The interval says how far a run's noise reaches: these tests build timings
whose answer is known by construction (every pair at one ratio, drift that
hits both calls of a pair alike, a clear slowdown under small noise, a
ratio just above its target under wide noise) and check the interval and
the verdict against it: pass where the ratio of medians meets the target,
"pass, within noise" where only the interval reaches it, FAIL where the
whole interval lies above it. Nothing here times anything.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

sys.path.insert(0, ROOT)
try:
    from benchmarks import report
    from benchmarks.common import FAIL, NOISE_PASS, PASS, Result, results_table, verdicts
finally:
    sys.path.remove(ROOT)


def _result(keras_times, memfit_times, call="fit"):
    return Result("mlp", call, 32, 320, len(keras_times), list(keras_times), list(memfit_times))


def _spread(center, step, n=21):
    """Times `center` +- `step`, `step` apart: `n` of them, their median exactly `center`."""
    return [center + step * (i - n // 2) for i in range(n)]


def _noisy(n, seed, spread):
    """`n` multiplicative noise factors around 1 (log-normal, sigma `spread`)."""
    rng = random.Random(seed)
    return [math.exp(rng.gauss(0.0, spread)) for _ in range(n)]


def test_every_pair_at_one_ratio_gives_an_interval_of_that_ratio_alone():
    keras = [1.0 + 0.01 * i for i in range(21)]
    result = _result(keras, [1.01 * k for k in keras])
    low, high = result.ratio_interval()
    assert low == high == result.ratio
    assert abs(result.ratio - 1.01) < 1e-12
    assert result.verdict == PASS  # 1.01 <= 1.02, and nothing uncertain about it


def test_drift_that_hits_both_calls_of_a_pair_does_not_widen_the_interval():
    # The machine's speed drifts threefold over the run; each pair's two calls see
    # the same speed. Resampling the two paths' times apart would mix slow Keras
    # calls with fast MemFit ones and give a wide interval; resampling pairs gives none.
    drift = [1.0 + 2.0 * i / 40 for i in range(41)]
    result = _result(drift, [1.03 * d for d in drift])
    low, high = result.ratio_interval()
    assert math.isclose(low, 1.03) and math.isclose(high, 1.03)
    assert result.verdict == FAIL  # 1.03 > 1.02, and no noise to reach it


def test_a_clear_slowdown_under_small_noise_is_resolved_as_a_failure():
    keras = _noisy(21, seed=1, spread=0.01)
    memfit = [1.10 * k * f for k, f in zip(keras, _noisy(21, seed=2, spread=0.01))]
    result = _result(keras, memfit)
    low, high = result.ratio_interval()
    assert 1.02 < low <= result.ratio <= high < 1.2
    assert result.verdict == FAIL and not result.passed


def test_a_ratio_above_its_target_whose_interval_reaches_it_is_a_pass_within_noise():
    # Keras steady at 1 s; MemFit's 21 calls spread +-10% around 1.03 s: the ratio
    # of medians is 1.03, above the fit target 1.02, but the noise reaches far below it.
    result = _result([1.0] * 21, _spread(1.03, 0.01))
    low, high = result.interval
    assert math.isclose(result.ratio, 1.03)
    assert low <= 1.02 < result.ratio <= high
    assert result.verdict == NOISE_PASS and result.passed


def test_a_ratio_under_its_target_is_a_plain_pass_whatever_its_interval_reaches():
    result = _result([1.0] * 21, _spread(1.01, 0.01))
    low, high = result.interval
    assert math.isclose(result.ratio, 1.01)
    assert low < result.ratio <= 1.02 < high  # the noise reaches above the target
    assert result.verdict == PASS


def test_the_interval_holds_the_ratio_and_narrows_with_more_pairs():
    def interval(n):
        keras = _noisy(n, seed=3, spread=0.1)
        memfit = [k * f for k, f in zip(keras, _noisy(n, seed=4, spread=0.1))]
        result = _result(keras, memfit)
        low, high = result.ratio_interval()
        assert low <= result.ratio <= high
        return high - low

    few, many = interval(21), interval(400)
    assert few > 0.05  # 10% noise on 21 pairs: a 2% target is inside it
    assert many < few / 2  # about sqrt(400 / 21) = 4.4 times narrower


def test_the_table_verdicts_and_summary_tell_a_pass_within_noise_from_a_pass_and_a_failure():
    keras = [1.0] * 21
    results = [
        _result(keras, _spread(1.00, 0.01), call="predict"),  # 1.00 <= 1.05: pass
        _result(keras, _spread(1.06, 0.01), call="evaluate"),  # 1.06 > 1.05, noise reaches it
        _result(keras, _spread(1.10, 0.001)),  # fit: 1.090-1.110, all above 1.02
    ]
    assert [r.verdict for r in results] == [PASS, NOISE_PASS, FAIL]
    table = results_table(results)
    assert "| 95% interval |" in table.splitlines()[0]
    rows = table.splitlines()[2:]
    # Every row: the point estimate, its interval, the target and the verdict.
    for result, row, verdict in zip(results, rows, ["pass", "pass, within noise", "FAIL"]):
        low, high = result.interval
        assert f"| **{result.ratio:.3f}** | {low:.3f}-{high:.3f} |" in row
        assert row.endswith(f"| {verdict} |"), row
    lines = verdicts(results).splitlines()
    assert lines[0].startswith("- **predict: target ratio <= 1.05 holds in all 1 cases**")
    assert lines[1].startswith("- **evaluate: target ratio <= 1.05 holds in all 1 cases, "
                               "1 of them within noise**")
    assert "mlp batch 32 (1.060, 95% interval " in lines[1]
    assert lines[2].startswith("- **fit: target ratio <= 1.02 fails in 1 of 1 cases**")
    assert "within noise" not in lines[0] + lines[2]
    # The summary's verdicts follow the same rule, and name the pass within noise.
    over = {"overhead": {"cases": [dataclasses.asdict(r) for r in results]}}
    summary = {row["figure"].split(",")[0]: row for row in report.summary_rows(over)}
    plain, noisy, failed = (summary["safe_predict vs model.predict"],
                            summary["safe_evaluate vs model.evaluate"],
                            summary["fit with MemFit() vs plain fit"])
    assert plain["ok"] is True and "within noise" not in plain["ratio"]
    assert noisy["ok"] is True and "within noise: mlp batch 32" in noisy["ratio"]
    low, high = results[2].interval
    assert failed["ok"] is False and f"1.100, 95% interval {low:.3f}-{high:.3f}" in failed["ratio"]


def _saved(tmp_path, devices_key):
    keras = [1.0, 1.1, 0.9]
    path = tmp_path / "timings.json"
    path.write_text(json.dumps({
        "cases": [dict(model="mlp", call="fit", batch_size=32, samples=320, repeats=3,
                       keras_times=keras, memfit_times=[1.5 * k for k in keras])],
        "machine": {"Date (UTC)": "2026-12-03 14:51", devices_key: "cpu"},
        "argv": ["--repeats", "3", "--json", "/somewhere/timings.json", "--write"],
        "end_load": "0.50 / 0.40 / 0.30",
    }))
    return path


def _rebuild(path, output, backend):
    env = dict(os.environ, KERAS_BACKEND=backend)
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.overhead", "--from-json", str(path),
         "--output", str(output)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )


def test_from_json_rebuilds_the_backends_section_from_saved_timings(tmp_path):
    output = tmp_path / "RESULTS.md"
    proc = _rebuild(_saved(tmp_path, "Devices seen by torch"), output, "torch")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    text = output.read_text()
    assert text.count("<!-- BEGIN benchmark: overhead-torch -->") == 1
    assert "Generated by `python -m benchmarks.overhead --repeats 3 --write`." in text
    assert "; Load average at end (1/5/15 min): 0.50 / 0.40 / 0.30." in text
    # 1.5 times Keras in every pair: ratio 1.5, an interval of 1.5 alone, a failure.
    assert "| **1.500** | 1.500-1.500 |" in text and "| FAIL |" in text


def test_from_json_refuses_timings_of_another_backend_and_writes_nothing(tmp_path):
    output = tmp_path / "RESULTS.md"
    proc = _rebuild(_saved(tmp_path, "Devices seen by JAX"), output, "torch")
    assert proc.returncode == 2
    assert "taken on the jax backend; received KERAS_BACKEND=torch" in proc.stderr
    assert not output.exists()
