"""What every benchmark shares: targets, result types, machine info, RESULTS.md sections.

The scenario scripts (`overhead`, `seed`, `hostmem`, `training`, `scaling` in
`run`) and the report (`report`) import from here, never from one another's
entry points, so that the imports point one way:
`run -> report -> {seed, hostmem, training} -> common`, `overhead -> common`.
This module imports only the standard library (and TensorFlow inside
`versions`, to ask what it sees).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import os
import platform
import random
import re
import statistics
from typing import Dict, List, Sequence, Tuple

MiB = 2**20

# --------------------------------------------------------------------------
# Targets (the acceptance criteria each scenario reports PASS/MISS against)
# --------------------------------------------------------------------------
OVERHEAD_TARGETS = {"predict": 1.05, "evaluate": 1.05, "fit": 1.02}
"""Overhead: keras_memfit time / Keras time (ratio of medians), per call."""
OVERHEAD_CALLS = ("predict", "evaluate", "fit")
OVERHEAD_CONFIDENCE = 0.95
"""Overhead: the confidence of the interval reported around each ratio of medians."""
BOOTSTRAP_RESAMPLES = 2000
"""Overhead: resamples of the interleaved pairs behind that interval (fixed seed)."""
PASS, NOISE_PASS, FAIL = "pass", "pass, within noise", "FAIL"
"""Overhead: the verdicts `ratio_verdict` gives (the table's Result column)."""
VERDICT_RULE = (
    f'Result: "{PASS}" where the ratio of medians meets the target; "{NOISE_PASS}" '
    "where it does not but the interval's lower bound does (this run's noise reaches "
    f'the target); "{FAIL}" only where the whole interval lies above the target.'
)
"""Overhead: `ratio_verdict`'s rule in words, for the sections that show its verdicts."""
SEED_TARGETS = {"safe": 1.3, "safe_second": 1.05}
"""Seed: safe_predict's first and second call / the oracle (ratio of medians)."""
HOSTMEM_TARGET_SHARE = 0.10
"""Host memory: peak added memory / output size, for the targeted approaches."""

FILE_HEADER = """# keras_memfit benchmarks

Each `benchmark: KEY` section is rewritten by its own script; `notes: KEY`
sections are written by hand. Timings come from shared, noisy machines: read
the ratios (measured side by side, interleaved), not the absolute times.
"""


# --------------------------------------------------------------------------
# Result types
# --------------------------------------------------------------------------
def ratio_verdict(ratio: float, interval: Tuple[float, float], target: float) -> str:
    """Whether a ratio of medians meets its target, given how far the run's noise reaches.

    Args:
        ratio: The ratio of medians (the point estimate).
        interval: (low, high), the interval around `ratio` (`Result.interval`).
        target: The largest ratio the target allows.

    Returns:
        `PASS` where `ratio` <= `target`; `NOISE_PASS` where it is above but
        `low` <= `target` (this run's noise reaches the target); `FAIL` only
        where the whole interval lies above the target.
    """
    if ratio <= target:
        return PASS
    return NOISE_PASS if interval[0] <= target else FAIL


@dataclasses.dataclass
class Result:
    """One overhead case: a model, a call and a batch size, timed both ways.

    Attributes:
        model: The model's name in `benchmarks.overhead.MODELS`.
        call: "predict", "evaluate" or "fit".
        batch_size: The batch size of both paths.
        samples: Samples per call.
        repeats: Timed calls per path.
        keras_times: Seconds of each plain Keras call.
        memfit_times: Seconds of each keras_memfit call, interleaved with them.
    """

    model: str
    call: str
    batch_size: int
    samples: int
    repeats: int
    keras_times: List[float]
    memfit_times: List[float]

    @property
    def steps(self) -> int:
        return -(-self.samples // self.batch_size)

    @property
    def keras_median(self) -> float:
        return statistics.median(self.keras_times)

    @property
    def memfit_median(self) -> float:
        return statistics.median(self.memfit_times)

    @property
    def ratio(self) -> float:
        """Ratio of the medians: the acceptance criterion."""
        return self.memfit_median / self.keras_median

    @property
    def paired_ratio(self) -> float:
        """Median over the interleaved pairs of memfit time / Keras time."""
        return statistics.median(m / k for m, k in zip(self.memfit_times, self.keras_times))

    @property
    def per_step_overhead_ms(self) -> float:
        return (self.memfit_median - self.keras_median) / self.steps * 1e3

    @property
    def target(self) -> float:
        return OVERHEAD_TARGETS[self.call]

    def ratio_interval(
        self, confidence: float = OVERHEAD_CONFIDENCE, resamples: int = BOOTSTRAP_RESAMPLES,
        seed: int = 0,
    ) -> Tuple[float, float]:
        """A percentile-bootstrap interval around `ratio`: how far this run's noise reaches.

        The interleaved pairs are resampled with replacement (a pair stays a
        pair, so drift that hit both of its calls stays cancelled), the ratio
        of medians is computed on each resample, and the interval is the
        central `confidence` share of those ratios. A fixed `seed` makes the
        interval a function of the timings alone.

        Returns:
            (low, high): both equal to `ratio` when every pair has the same ratio.
        """
        pairs = list(zip(self.memfit_times, self.keras_times))
        rng = random.Random(seed)
        ratios = []
        for _ in range(resamples):
            sample = rng.choices(pairs, k=len(pairs))
            ratios.append(statistics.median(m for m, _ in sample)
                          / statistics.median(k for _, k in sample))
        ratios.sort()
        tail = (1.0 - confidence) / 2.0
        low = ratios[int(tail * (resamples - 1))]
        high = ratios[int(round((1.0 - tail) * (resamples - 1)))]
        return low, high

    @functools.cached_property
    def interval(self) -> Tuple[float, float]:
        """`ratio_interval()` at its defaults, computed once (the table and verdicts read it)."""
        return self.ratio_interval()

    @property
    def verdict(self) -> str:
        """`ratio_verdict` of this case: `PASS`, `NOISE_PASS` or `FAIL`."""
        return ratio_verdict(self.ratio, self.interval, self.target)

    @property
    def passed(self) -> bool:
        """Whether the target holds, plainly or within this run's noise (not `FAIL`)."""
        return self.verdict != FAIL

    @property
    def interval_text(self) -> str:
        low, high = self.interval
        return f"{low:.3f}-{high:.3f}"


def _span(times: List[float]) -> str:
    return f"{statistics.median(times):.3f} ({min(times):.3f}-{max(times):.3f})"


def results_table(results: Sequence[Result]) -> str:
    """The overhead cases as a Markdown table."""
    lines = [
        "| Model | Call | Batch | Samples (steps) | Repeats | Keras s: median (min-max) "
        "| keras_memfit s: median (min-max) | Ratio of medians "
        f"| {OVERHEAD_CONFIDENCE:.0%} interval | Median paired ratio "
        "| Extra ms/step | Target | Result |",
        "|---|---|---:|---:|---:|---:|---:|---:|:---:|---:|---:|:---:|:---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.model} | {r.call} | {r.batch_size} | {r.samples} ({r.steps}) | "
            f"{r.repeats} | {_span(r.keras_times)} | {_span(r.memfit_times)} | "
            f"**{r.ratio:.3f}** | {r.interval_text} | {r.paired_ratio:.3f} | "
            f"{r.per_step_overhead_ms:+.3f} | <= {r.target} | {r.verdict} |"
        )
    return "\n".join(lines)


def _case(r: Result) -> str:
    return (f"{r.model} batch {r.batch_size} ({r.ratio:.3f}, "
            f"{OVERHEAD_CONFIDENCE:.0%} interval {r.interval_text})")


def verdicts(results: Sequence[Result]) -> str:
    """One line per call: whether its target holds in every case, plainly or within noise."""
    lines = []
    for call in OVERHEAD_CALLS:
        mine = [r for r in results if r.call == call]
        if not mine:
            continue
        failed = [r for r in mine if r.verdict == FAIL]
        noisy = [r for r in mine if r.verdict == NOISE_PASS]
        target = OVERHEAD_TARGETS[call]
        noise = ("ratio above the target, interval reaching it: "
                 f"{', '.join(_case(r) for r in noisy)}")
        if failed:
            line = (f"- **{call}: target ratio <= {target} fails in {len(failed)} of "
                    f"{len(mine)} cases** (whole interval above it: "
                    f"{', '.join(_case(r) for r in failed)}).")
            if noisy:
                line += f" Within noise: {len(noisy)} ({noise})."
        elif noisy:
            line = (f"- **{call}: target ratio <= {target} holds in all {len(mine)} cases, "
                    f"{len(noisy)} of them within noise** ({noise}).")
        else:
            worst = max(mine, key=lambda r: r.ratio)
            line = (f"- **{call}: target ratio <= {target} holds in all {len(mine)} cases** "
                    f"(worst: {_case(worst)}).")
        lines.append(line)
    return "\n".join(lines)


# --------------------------------------------------------------------------
# Machine info
# --------------------------------------------------------------------------
def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def usable_cpus() -> str:
    """"usable / total" CPU count."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return f"{usable} / {os.cpu_count()}"


def load_average() -> str:
    """The 1/5/15-minute load average, "n/a" where there is none."""
    try:
        return " / ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "n/a"


def machine_line(info: Dict[str, str]) -> str:
    """The machine and versions a section was measured on, as one Markdown line.

    Example:
        >>> machine_line({"CPU": "AMD EPYC", "Python": "3.11.7"})
        'Machine: CPU: AMD EPYC; Python: 3.11.7.'
    """
    return "Machine: " + "; ".join(f"{k}: {v}" for k, v in info.items()) + "."


def now_utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")


def versions() -> Dict[str, str]:
    """Versions of what runs, and the devices the Keras backend sees.

    Imports Keras, then the active backend's library (TensorFlow, JAX with
    `KERAS_BACKEND=jax`, torch with `KERAS_BACKEND=torch`) to ask what it
    sees; the devices are the last key, "Devices seen by TensorFlow", "...
    by JAX" or "... by torch".
    """
    import keras
    import numpy as np

    if keras.backend.backend() == "torch":
        import torch

        devices = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
        return {
            "Python": platform.python_version(),
            "torch": torch.__version__,
            "Keras": keras.__version__,
            "NumPy": np.__version__,
            "Devices seen by torch": ", ".join(devices),
        }
    if keras.backend.backend() == "jax":
        import jax

        return {
            "Python": platform.python_version(),
            "JAX": jax.__version__,
            "Keras": keras.__version__,
            "NumPy": np.__version__,
            "Devices seen by JAX": ", ".join(f"{d.platform}:{d.id}" for d in jax.devices()),
        }
    import tensorflow as tf

    return {
        "Python": platform.python_version(),
        "TensorFlow": tf.__version__,
        "Keras": keras.__version__,
        "NumPy": np.__version__,
        "Devices seen by TensorFlow": ", ".join(
            d.name.replace("/physical_device:", "") for d in tf.config.list_physical_devices()
        ),
    }


# --------------------------------------------------------------------------
# RESULTS.md sections
# --------------------------------------------------------------------------
def _markers(key: str) -> Tuple[str, str]:
    return f"<!-- BEGIN benchmark: {key} -->", f"<!-- END benchmark: {key} -->"


def update_section(text: str, key: str, body: str, first: bool = False) -> str:
    """`text` with `key`'s generated section replaced, or added (at the top if `first`)."""
    begin, end = _markers(key)
    block = f"{begin}\n{body.strip()}\n{end}"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
    if pattern.search(text):
        return pattern.sub(lambda _: block, text, count=1)
    if first:
        match = re.search(r"^<!-- BEGIN ", text, re.MULTILINE)
        if match:
            return text[:match.start()] + block + "\n\n" + text[match.start():]
    return text.rstrip("\n") + "\n\n" + block + "\n"


def read_results_file(path: str) -> str:
    """The text of the results file at `path`, or a new file's header."""
    if not os.path.exists(path):
        return FILE_HEADER
    with open(path) as f:
        return f.read()


def write_section(path: str, key: str, body: str) -> None:
    """Replace (or append) the text between `key`'s markers in the file at `path`."""
    text = update_section(read_results_file(path), key, body)
    with open(path, "w") as f:
        f.write(text)
