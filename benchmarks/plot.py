"""results.png: the figures of every scenario, drawn from the raw results (results.json).

`python -m benchmarks.run` calls `write_plot` after `report.write_markdown`;
the figures are the ones RESULTS.md tabulates (median, min-max over the
repeats, the targets), with matplotlib's Agg backend.
"""

from __future__ import annotations

from typing import Any, Dict, List

from benchmarks import hostmem, seed, training
from benchmarks.common import OVERHEAD_TARGETS, MiB
from benchmarks.report import (
    by_approach,
    cap_text,
    median,
    scaling_failures,
    scaling_samples,
    seed_times,
)


def write_plot(path: str, results: Dict[str, Any]) -> None:
    """Draw the figures of every scenario present into one PNG (matplotlib, Agg).

    Raises:
        RuntimeError: If matplotlib is not installed (`pip install ".[bench]"`).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise RuntimeError(
            "benchmarks need matplotlib to draw results.png; install it with "
            "`pip install \".[bench]\"` (or pass --no-plot)"
        ) from err

    fig, axes = plt.subplots(2, 3, figsize=(17, 9.5))
    axes = axes.ravel()
    _plot_overhead(axes[0], results.get("overhead"))
    _plot_seed(axes[1], results.get("seed"))
    _plot_hostmem(axes[2], results.get("hostmem"))
    _plot_training(axes[3], results.get("training"))
    _plot_scaling_samples(axes[4], results.get("scaling"), results.get("seed"))
    _plot_scaling_overshoot(axes[5], results.get("scaling"))
    date = max((results[k]["date"] for k in results if isinstance(results[k], dict)
                and "date" in results[k]), default="")
    machine = results.get("machine", {})
    fig.suptitle(
        f"keras_memfit benchmarks ({machine.get('CPU', 'CPU')}, "
        f"{machine.get('CPU count (usable / total)', '?')} CPUs; TensorFlow "
        f"{machine.get('TensorFlow', '?')}, Keras {machine.get('Keras', '?')}; {date} UTC)",
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _empty(ax, title: str) -> None:
    ax.set_title(title, fontsize=10)
    ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def _plot_overhead(ax, over) -> None:
    title = "1. Overhead, no memory pressure (ratio of medians)"
    if not over:
        return _empty(ax, title)
    cases = over["cases"]
    labels = [f"{c['model']}\n{c['call']} {c['batch_size']}" for c in cases]
    ratios = [median(c["memfit_times"]) / median(c["keras_times"]) for c in cases]
    colors = {"predict": "tab:blue", "evaluate": "tab:green", "fit": "tab:orange"}
    ax.barh(range(len(cases)), ratios, color=[colors[c["call"]] for c in cases])
    for i, c in enumerate(cases):
        ax.plot([OVERHEAD_TARGETS[c["call"]]] * 2, [i - 0.4, i + 0.4], "k--", lw=1)
    ax.axvline(1.0, color="grey", lw=0.8)
    ax.set_yticks(range(len(cases)))
    ax.set_yticklabels(labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("keras_memfit time / Keras time (dashed: target)")
    ax.set_title(title, fontsize=10)


def _plot_seed(ax, sd) -> None:
    title = "2. Seed: time to the predictions under the cap"
    if not sd:
        return _empty(ax, title)
    title = f"2. Seed: time to {sd['n']:,} predictions under the cap"
    times = seed_times(sd)
    ooms = {r["approach"]: r["ooms"] for r in sd["runs"]}
    ooms["safe_second"] = next((r["second_ooms"] for r in sd["runs"]
                                if r["approach"] == "safe"), 0)
    order = sorted(times, key=lambda k: median(times[k]))
    meds = [median(times[k]) for k in order]
    colors = ["tab:green" if k.startswith("safe") else
              "tab:grey" if k == "oracle" else "tab:red" for k in order]
    ax.barh(range(len(order)), meds, color=colors)
    for i, k in enumerate(order):
        lo, hi = min(times[k]), max(times[k])
        ax.plot([lo, hi], [i, i], "k-", lw=1)
        ax.text(hi, i, f"  {meds[i]:.0f} s, {ooms.get(k, 0)} OOM", va="center", fontsize=7)
    ax.set_yticks(range(len(order)))
    ax.set_yticklabels([seed.LABELS[k].replace(" (", "\n(").replace(": ", ":\n")
                        for k in order], fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel(f"seconds (log; median, line: min-max); {cap_text(sd['cap_mb'])}")
    ax.set_title(title, fontsize=10)


def _plot_hostmem(ax, hm) -> None:
    title = "3. Host memory added, large output"
    if not hm:
        return _empty(ax, title)
    shares = by_approach(hm["runs"], "added_share")
    keys = [k for k in hostmem.APPROACHES if k in shares]
    meds = [100 * median(shares[k]) for k in keys]
    ax.bar(range(len(keys)), meds, color=["tab:red"] + ["tab:green"] * (len(keys) - 1))
    for i, m in enumerate(meds):
        ax.text(i, m, f"{m:.1f}%", ha="center", va="bottom", fontsize=8)
    ax.axhline(100 * hostmem.TARGET_SHARE, color="k", ls="--", lw=1)
    ax.set_xticks(range(len(keys)))
    short = {"predict": "model.predict", "safe": "safe_predict",
             "safe_argmax": "safe_predict\n(postprocess=\nargmax)",
             "safe_memmap": "safe_predict\n(out=\nnp.memmap)"}
    ax.set_xticklabels([short[k] for k in keys], fontsize=7)
    ax.set_ylabel(f"peak added / output size (%), output {hm['output_bytes'] / MiB:.0f} MiB")
    ax.set_title(title + " (dashed: target)", fontsize=10)


def _plot_training(ax, tr) -> None:
    title = "4. Training under the cap"
    if not tr:
        return _empty(ax, title)
    secs = by_approach(tr["runs"])
    keys = [k for k in training.APPROACHES if k in secs]
    meds = [median(secs[k]) for k in keys]
    ax.bar(range(len(keys)), meds, color=["tab:grey", "tab:green", "tab:green", "tab:red"]
           [: len(keys)])
    losses = {k: median([r["final_loss"] for r in tr["runs"] if r["approach"] == k])
              for k in keys}
    ooms = {r["approach"]: r["ooms"] for r in tr["runs"]}
    for i, k in enumerate(keys):
        ax.text(i, meds[i], f"{meds[i]:.0f} s\nloss {losses[k]:.4f}\n{ooms[k]} OOM",
                ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(keys)))
    ax.set_xticklabels([training.LABELS[k].replace(", ", ",\n").replace(" (", "\n(")
                        .replace("(mode", "(\nmode") for k in keys], fontsize=7)
    ax.set_ylabel(f"seconds for {tr['epochs']} epochs")
    ax.set_ylim(0, max(meds) * 1.35)
    ax.set_title(title, fontsize=10)


_STYLE = {"oracle": ("tab:grey", "s"), "safe": ("tab:green", "o"), "halving": ("tab:red", "^"),
          "decay": ("tab:purple", "v"), "finder": ("tab:orange", "D"),
          "manual_split": ("tab:brown", "x")}


def _plot_scaling_samples(ax, sc, sd) -> None:
    title = "5a. Scaling with samples (requested batch = all)"
    if not sc:
        return _empty(ax, title)
    samples = scaling_samples(sc, sd)
    failures = scaling_failures(samples)
    top = max((p["seconds"] for p in samples if not p.get("failed")), default=1.0)
    shift = 1.0  # the failures' crosses, side by side
    for a in sc["approaches"]:
        by_n: Dict[int, List[float]] = {}
        for p in samples:
            if p["approach"] == a and not p.get("failed"):
                by_n.setdefault(p["n"], []).append(p["seconds"])
        pts = sorted((n, median(v)) for n, v in by_n.items())
        color, marker = _STYLE.get(a, ("k", "."))
        ax.plot([n for n, _ in pts], [s for _, s in pts], marker=marker, color=color,
                label=seed.LABELS[a].split(":")[0])
        failed = sorted(p["n"] for p in samples if p["approach"] == a and p.get("failed"))
        if failed:  # a failure has no time: a cross above every time, not a point on the line
            ax.plot([n * shift for n in failed], [top * 4] * len(failed), marker="X",
                    ls="none", color=color, markersize=10, markeredgecolor="k")
            shift *= 0.9
    short = {"halving": "halving", "decay": "0.9 decay", "finder": "finder"}
    names = " and ".join(short.get(a, a) for a in sc["approaches"] if a in seed.WHOLE_INPUT)
    for n, probe in failures.items():
        ax.annotate(f"{names}: model.predict OOMs at any batch\n(whole input does not fit; "
                    f"batch {probe['batch_size']}:\n{probe['error']} after "
                    f"{probe['seconds']:.0f} s)", (n * shift, top * 4), xytext=(-10, 0),
                    textcoords="offset points", ha="right", va="center", fontsize=7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    if failures:
        bottom = min(p["seconds"] for p in samples if not p.get("failed"))
        ax.set_ylim(bottom / 2, top * 12)
    ax.set_xlabel("samples (X: fails, no time)" if failures else "samples")
    ax.set_ylabel("seconds to predictions")
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title(title, fontsize=10)


def _plot_scaling_overshoot(ax, sc) -> None:
    title = "5b. Scaling with overshoot (requested / fitting batch)"
    if not sc:
        return _empty(ax, title)
    for a in sc["approaches"]:
        if a == "oracle":
            continue
        pts = sorted((p["factor"], p["seconds"]) for p in sc["overshoot"] if p["approach"] == a)
        color, marker = _STYLE.get(a, ("k", "."))
        ax.plot([f for f, _ in pts], [s for _, s in pts], marker=marker, color=color,
                label=seed.LABELS[a].split(":")[0])
    if sc.get("overshoot_oracle_seconds"):
        ax.axhline(sc["overshoot_oracle_seconds"], color="tab:grey", ls="--", lw=1,
                   label="oracle")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"requested batch / oracle batch ({sc['overshoot_n']:,} samples)")
    ax.set_ylabel("seconds to predictions")
    ax.legend(fontsize=7)
    ax.set_title(title, fontsize=10)
