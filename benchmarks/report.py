"""RESULTS.md sections from the raw results (results.json).

`python -m benchmarks.run` stores every scenario's raw measurements in
`results.json` and calls `write_markdown`, which regenerates each generated
section of RESULTS.md (between `<!-- BEGIN benchmark: KEY -->` and
`<!-- END benchmark: KEY -->`; `notes: KEY` sections are hand-written and
kept), then `benchmarks.plot.write_plot` for results.png. Figures: median
(min-max) over the repeats, ratio of medians against the reference, the
target and PASS/MISS (overhead: `benchmarks.common.ratio_verdict`, which
passes a ratio above its target where its interval reaches the target, and
says so).
"""

from __future__ import annotations

import statistics
from typing import Any, Dict, List, Optional, Sequence

from benchmarks import hostmem, seed, training
from benchmarks.common import (
    NOISE_PASS,
    OVERHEAD_CONFIDENCE,
    OVERHEAD_TARGETS,
    SEED_TARGETS,
    MiB,
    VERDICT_RULE,
    Result,
    machine_line,
    read_results_file,
    results_table,
    update_section,
    verdicts,
)


# --------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------
def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def span(values: Sequence[float], fmt: str = "{:.2f}") -> str:
    """'median (min-max)', or the single value when there is one."""
    if not values:
        return "n/a"
    if len(values) == 1:
        return fmt.format(values[0]) + " (1 run)"
    return f"{fmt.format(median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def cap_text(cap_mb: int) -> str:
    return f"a {cap_mb} MiB cap" if cap_mb else "no cap (--quick)"


def verdict(ok: Optional[bool]) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "**MISS**")


def by_approach(runs: List[Dict[str, Any]], key: str = "seconds") -> Dict[str, List[float]]:
    out: Dict[str, List[float]] = {}
    for r in runs:
        out.setdefault(r["approach"], []).append(r[key])
    return out


# --------------------------------------------------------------------------
# Figures with targets (the summary table)
# --------------------------------------------------------------------------
def summary_rows(results: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One row per figure that has a target: what, measured, reference, ratio, verdict."""
    rows: List[Dict[str, Any]] = []
    over = results.get("overhead")
    if over:
        labels = {"predict": "safe_predict vs model.predict",
                  "evaluate": "safe_evaluate vs model.evaluate",
                  "fit": "fit with MemFit() vs plain fit"}
        for call, label in labels.items():
            cases = [Result(**c) for c in over["cases"] if c["call"] == call]
            if not cases:
                continue
            worst = max(cases, key=lambda r: r.ratio)
            ratios = [r.ratio for r in cases]
            noisy = [r for r in cases if r.verdict == NOISE_PASS]
            within = ("" if not noisy else "; within noise: " + ", ".join(
                f"{r.model} batch {r.batch_size}" for r in noisy))
            rows.append(dict(
                scenario="1. overhead", figure=f"{label}, worst of {len(cases)} cases "
                f"({worst.model}, batch {worst.batch_size})",
                measured=span(worst.memfit_times, "{:.3f}") + " s",
                reference=span(worst.keras_times, "{:.3f}") + " s",
                ratio=f"{worst.ratio:.3f}, {OVERHEAD_CONFIDENCE:.0%} interval "
                f"{worst.interval_text} (all: {', '.join(f'{r:.2f}' for r in ratios)}{within})",
                target=f"<= {OVERHEAD_TARGETS[call]}", ok=all(r.passed for r in cases),
                value=worst.ratio,
            ))
    sd = results.get("seed")
    if sd:
        times = seed_times(sd)
        cpu = seed_times(sd, cpu=True)
        oracle = times.get("oracle")
        for key, target in SEED_TARGETS.items():
            if key in times and oracle:
                ratio = median(times[key]) / median(oracle)
                cpu_ratio = median(cpu[key]) / median(cpu["oracle"])
                rows.append(dict(
                    scenario=f"2. seed ({sd['n']:,} digits)",
                    figure=f"{seed.LABELS[key]} vs oracle",
                    measured=span(times[key]) + " s", reference=span(oracle) + " s",
                    ratio=f"{ratio:.3f} (CPU time: {cpu_ratio:.3f})", target=f"<= {target}",
                    ok=ratio <= target, value=ratio,
                ))
        if "safe" in times:
            others = {k: v for k, v in times.items() if k not in ("safe", "safe_second", "oracle")}
            if others:
                best = min(others, key=lambda k: median(others[k]))
                ratio = median(times["safe"]) / median(others[best])
                rows.append(dict(
                    scenario=f"2. seed ({sd['n']:,} digits)",
                    figure=f"safe_predict, 1st call vs the fastest other approach "
                    f"({seed.LABELS[best]})",
                    measured=span(times["safe"]) + " s", reference=span(others[best]) + " s",
                    ratio=f"{ratio:.3f}", target="< 1", ok=ratio < 1, value=ratio,
                ))
    hm = results.get("hostmem")
    if hm:
        shares = by_approach(hm["runs"], "added_share")
        for key in hostmem.TARGETED:
            if key in shares:
                worst = max(shares[key])
                rows.append(dict(
                    scenario="3. host memory", figure=f"{hostmem.LABELS[key]}: peak added "
                    "memory / output size", measured=span([100 * s for s in shares[key]],
                                                          "{:.1f}") + " %",
                    reference=f"output {hm['output_bytes'] / MiB:.0f} MiB",
                    ratio=f"{worst:.3f} (worst run)", target=f"< {hostmem.TARGET_SHARE}",
                    ok=worst < hostmem.TARGET_SHARE, value=worst,
                ))
    return rows


def summary_markdown(results: Dict[str, Any]) -> str:
    rows = summary_rows(results)
    quick = any("--quick" in str(v.get("command", "")) for v in results.values()
                if isinstance(v, dict))
    lines = [
        "## Summary: the targets",
        "",
    ]
    if quick:
        lines += ["**A `--quick` smoke run: tiny sizes, no memory cap, one process. These",
                  "numbers only show that the benchmarks run; they measure nothing.**", ""]
    lines += [
        "Ratio of medians (measured / reference) over interleaved runs, each in a",
        "fresh process; times are seconds, `median (min-max)` over the repeats.",
        "",
        "| Scenario | Figure | Measured | Reference | Ratio | Target | Result |",
        "|---|---|---:|---:|---:|:---:|:---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['scenario']} | {r['figure']} | {r['measured']} | {r['reference']} | "
            f"{r['ratio']} | {r['target']} | {verdict(r['ok'])} |"
        )
    missed = [r for r in rows if r["ok"] is False]
    lines.append("")
    if missed:
        lines.append(f"**{len(missed)} of {len(rows)} targets missed**: see the scenario's "
                     "section and the notes below.")
    else:
        lines.append(f"All {len(rows)} targets met in this run.")
    lines.append("")
    lines.append("![keras_memfit benchmarks](results.png)")
    lines.append("")
    lines.append(machine_markdown(results))
    return "\n".join(lines)


def machine_markdown(results: Dict[str, Any]) -> str:
    machine = dict(results.get("machine", {}))
    ran = [f"{name} {results[name]['date']}" for name in
           ("overhead", "seed", "hostmem", "training", "scaling") if name in results]
    if ran:
        machine["Scenarios run (UTC)"] = ", ".join(ran)
    return machine_line(machine)


# --------------------------------------------------------------------------
# Scenario sections
# --------------------------------------------------------------------------
def seed_times(sd: Dict[str, Any], cpu: bool = False) -> Dict[str, List[float]]:
    """Seconds per approach (wall, or CPU time of the child with `cpu`)."""
    prefix = "cpu_" if cpu else ""
    times = by_approach(sd["runs"], prefix + "seconds")
    second = [r["second_" + prefix + "seconds"] for r in sd["runs"] if r["approach"] == "safe"]
    if second:
        times["safe_second"] = second
    return times


def seed_markdown(sd: Dict[str, Any]) -> str:
    times = seed_times(sd)
    cpu = seed_times(sd, cpu=True)
    oracle = median(times["oracle"]) if "oracle" in times else None
    oracle_cpu = median(cpu["oracle"]) if "oracle" in cpu else None
    ooms: Dict[str, List[int]] = {}
    batches: Dict[str, List[int]] = {}
    for r in sd["runs"]:
        ooms.setdefault(r["approach"], []).append(r["ooms"])
        batches.setdefault(r["approach"], []).append(r["batch_size"])
        if r["approach"] == "safe":
            ooms.setdefault("safe_second", []).append(r["second_ooms"])
            batches.setdefault("safe_second", []).append(r["second_batch_size"])
    order = sorted(times, key=lambda k: median(times[k]))
    lines = [
        f"## 2. The seed scenario: {sd['n']:,} digit images under {cap_text(sd['cap_mb'])}",
        "",
        f"Generated by `{sd['command']}` on {sd['date']} UTC.",
        "",
        f"The demo's CNN (`keras_memfit.app.demo.build_cnn`) on {sd['n']:,} generated test digits,",
        f"requested batch {sd['requested']:,} (the whole set). The oracle's batch, "
        f"{sd['oracle_batch']}, is the largest",
        "the whole `model.predict` call ran with in an untimed bisection (smallest failure:",
        f"{sd.get('smallest_failed')}). Each approach runs in a fresh process, OOM waits included,",
        f"its predictions checked against the oracle's. Repeats: {sd['repeats_note']}.",
        "CPU seconds (the child's process time, all threads) leave out the OOM waits and",
        "vary less with other jobs than wall time.",
        "",
        "| Approach | Seconds: median (min-max) | Ratio to oracle | OOMs paid | Batch used "
        "| CPU s: median | CPU ratio to oracle |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for key in order:
        ratio = f"{median(times[key]) / oracle:.2f}" if oracle else "n/a"
        cpu_ratio = f"{median(cpu[key]) / oracle_cpu:.2f}" if oracle_cpu else "n/a"
        b = sorted(set(batches.get(key, [])))
        o = sorted(set(ooms.get(key, [])))
        lines.append(
            f"| {seed.LABELS[key]} | {span(times[key])} | {ratio} | "
            f"{', '.join(map(str, o))} | {', '.join(map(str, b))} | "
            f"{median(cpu[key]):.2f} | {cpu_ratio} |"
        )
    lines.append("")
    first = [r.get("first_sizes") for r in sd["runs"] if r["approach"] == "safe"]
    if first and first[0]:
        lines.append(f"safe_predict's first pieces: {first[0]} (probes, then the estimate).")
    return "\n".join(lines)


def overhead_markdown(over: Dict[str, Any]) -> str:
    results = [Result(**c) for c in over["cases"]]
    return "\n".join([
        "## 1. Overhead with no memory pressure",
        "",
        f"Generated by `{over['command']}` on {over['date']} UTC, in one fresh process with",
        f"the CPU allocator capped at {over['cap_mb']} MiB (far above what these cases use).",
        "Method: `benchmarks/overhead.py`'s docstring. The "
        f"{OVERHEAD_CONFIDENCE:.0%} interval is a bootstrap of the",
        "ratio of medians over the pairs (how far the run's noise reaches).",
        VERDICT_RULE,
        "",
        results_table(results),
        "",
        verdicts(results),
    ])


def hostmem_markdown(hm: Dict[str, Any]) -> str:
    added = by_approach(hm["runs"], "added_bytes")
    shares = by_approach(hm["runs"], "added_share")
    hwm = by_approach([r for r in hm["runs"] if r.get("hwm_added_bytes") is not None],
                      "hwm_added_bytes")
    secs = by_approach(hm["runs"])
    lines = [
        f"## 3. Host memory: a {hm['n']:,} x {hm['width']:,} float32 output "
        f"({hm['output_bytes'] / MiB:.0f} MiB)",
        "",
        f"Generated by `{hm['command']}` on {hm['date']} UTC. No allocator cap (this is",
        "about host RAM). Peak anonymous resident memory added over a baseline taken after",
        "the model, the input and a warm-up call on 4,096 rows, sampled every millisecond;",
        "VmHWM (peak resident including file-backed pages, such as the memmap's) alongside.",
        f"batch_size={hm['batch_size']}; {hm['repeats']} run(s) per approach, each in a fresh "
        "process.",
        "",
        "| Approach | Added anon. MiB: median (min-max) | Share of output | VmHWM added MiB "
        "| Seconds | Target | Result |",
        "|---|---:|---:|---:|---:|:---:|:---:|",
    ]
    for key in hostmem.APPROACHES:
        if key not in added:
            continue
        targeted = key in hostmem.TARGETED
        ok = max(shares[key]) < hostmem.TARGET_SHARE if targeted else None
        lines.append(
            f"| {hostmem.LABELS[key]} | {span([a / MiB for a in added[key]], '{:.0f}')} | "
            f"{median(shares[key]):.1%} | "
            f"{span([a / MiB for a in hwm.get(key, [])], '{:.0f}')} | {span(secs[key])} | "
            f"{'< 10%' if targeted else '-'} | {verdict(ok) if targeted else '-'} |"
        )
    return "\n".join(lines)


def training_markdown(tr: Dict[str, Any]) -> str:
    runs = tr["runs"]
    secs = by_approach(runs)
    ref = [r for r in runs if r["approach"] == "uncapped"]
    ref_loss = median([r["final_loss"] for r in ref]) if ref else None
    lines = [
        f"## 4. Training under the cap: {tr['epochs']} epochs of {tr['n']:,} digits, "
        f"batch_size={tr['batch_size']}",
        "",
        f"Generated by `{tr['command']}` on {tr['date']} UTC. CPU allocator: "
        f"{cap_text(tr['cap_mb'])}",
        f"(the uncapped reference: {training.UNCAPPED_MB} MiB). The demo's CNN, the same initial",
        "weights in every process, `shuffle=False`. \"Final loss\" is the trained model's loss",
        "on the whole training set (`safe_evaluate`, untimed); the last epoch's logged loss is",
        f"beside it. {tr['repeats']} run(s) per approach, interleaved, each in a fresh process.",
        "",
        "| Approach | Seconds: median (min-max) | Ratio to uncapped | OOMs paid | Batch / split "
        "| Optimizer steps | Final loss | vs uncapped | Last epoch loss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ref_secs = median(secs["uncapped"]) if "uncapped" in secs else None
    for key in training.APPROACHES:
        mine = [r for r in runs if r["approach"] == key]
        if not mine:
            continue
        r0 = mine[-1]
        loss = median([r["final_loss"] for r in mine])
        diff = f"{loss - ref_loss:+.2e}" if ref_loss is not None else "n/a"
        how = f"{r0['batch_size']}" + (f", split {r0['split']}" if "split" in r0 else "")
        lines.append(
            f"| {training.LABELS[key]} | {span(secs[key])} | "
            f"{median(secs[key]) / ref_secs:.2f} | "
            f"{', '.join(map(str, sorted({r['ooms'] for r in mine})))} | {how} | "
            f"{r0['optimizer_steps']} | {loss:.5f} | {diff} | "
            f"{median([r['last_epoch_loss'] for r in mine]):.5f} |"
            if ref_secs else f"| {training.LABELS[key]} | {span(secs[key])} | n/a | | | | | | |"
        )
    return "\n".join(lines)


def scaling_samples(sc: Dict[str, Any], sd: Optional[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The samples axis: scaling's own points plus the seed scenario's (same model and cap).

    Where the probe found that `model.predict` cannot run at all (a small
    batch ran out of memory), each model.predict-based approach gets a point
    with `failed=True` and the probe's outcome instead of a time.
    """
    points = list(sc["samples"])
    if sd and sd.get("cap_mb") == sc.get("cap_mb"):
        points = [p for p in points if p["n"] != sd["n"]]
        points += [r for r in sd["runs"] if r["approach"] in sc["approaches"]]
    for probe in sc.get("probes", []):
        if not probe["ok"]:
            points += [dict(approach=a, n=probe["n"], failed=True, probe=probe)
                       for a in sc["approaches"] if a in seed.WHOLE_INPUT]
    return points


def scaling_failures(samples: List[Dict[str, Any]]) -> Dict[int, Dict[str, Any]]:
    """The failed probes by sample count."""
    return {p["n"]: p["probe"] for p in samples if p.get("failed")}


def scaling_markdown(results: Dict[str, Any]) -> str:
    sc = results["scaling"]
    samples = scaling_samples(sc, results.get("seed"))
    failures = scaling_failures(samples)
    lines = [
        "## 5. Scaling: samples, and how far the requested batch overshoots",
        "",
        f"Generated by `{sc['command']}` on {sc['date']} UTC. The seed scenario's model, "
        f"{cap_text(sc['cap_mb'])}",
        f"and oracle batch ({sc['oracle_batch']}); one run per point, each in a fresh process; "
        "the",
        f"{format(results['seed']['n'], ',') if 'seed' in results else 'largest'}-sample "
        "row is the seed scenario's median. Where a first probe of `model.predict`",
        "runs out of memory, the approaches built on one `model.predict` call are not run (*fails*).",
        "",
        "Samples (requested batch = all of them, as in the seed):",
        "",
        "| Samples | " + " | ".join(seed.LABELS[a] for a in sc["approaches"]) + " |",
        "|---:|" + "---:|" * len(sc["approaches"]),
    ]
    for n in sorted({p["n"] for p in samples}):
        cells = []
        for a in sc["approaches"]:
            pts = [p for p in samples if p["n"] == n and p["approach"] == a]
            if pts and pts[0].get("failed"):
                cells.append("*fails* at any batch size (whole input does not fit)")
            else:
                cells.append(f"{median([p['seconds'] for p in pts]):.1f} s "
                             f"({pts[0]['ooms']} OOM)" if pts else "-")
        lines.append(f"| {n:,} | " + " | ".join(cells) + " |")
    for n, probe in sorted(failures.items()):
        lines += [
            "",
            f"*fails* at {n:,} samples: the probe, `model.predict(x, "
            f"batch_size={probe['batch_size']})` in a fresh process under the cap, raised "
            f"`{probe['error']}` after {probe['seconds']:.1f} s: "
            f"`{probe['detail']}`: the whole input, {n * 28 * 28 * 4 / 1e6:.0f} MB as float32, "
            "is already one tensor",
            "in the capped allocator, so no batch size can help.",
        ]
    over_apps = [a for a in sc["approaches"] if a != "oracle"]
    lines += [
        "",
        f"Overshoot ({sc['overshoot_n']:,} samples; requested batch = factor x the oracle's "
        "batch; the oracle's time at that size for reference: "
        f"{sc.get('overshoot_oracle_seconds', float('nan')):.1f} s):",
        "",
        "| Factor | Requested | " + " | ".join(seed.LABELS[a] for a in over_apps) + " |",
        "|---:|---:|" + "---:|" * len(over_apps),
    ]
    for f in sorted({p["factor"] for p in sc["overshoot"]}):
        pts = [p for p in sc["overshoot"] if p["factor"] == f]
        cells = []
        for a in over_apps:
            mine = [p for p in pts if p["approach"] == a]
            cells.append(f"{mine[0]['seconds']:.1f} s ({mine[0]['ooms']} OOM)" if mine else "-")
        lines.append(f"| {f:g} | {pts[0]['requested']:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


SECTIONS = (
    ("summary", summary_markdown, None),
    ("overhead", overhead_markdown, "overhead"),
    ("seed", seed_markdown, "seed"),
    ("hostmem", hostmem_markdown, "hostmem"),
    ("training", training_markdown, "training"),
    ("scaling", scaling_markdown, "scaling*"),
)


# --------------------------------------------------------------------------
# RESULTS.md
# --------------------------------------------------------------------------
def write_markdown(path: str, results: Dict[str, Any]) -> None:
    """Regenerate every section `results` has data for; keep everything else in `path`."""
    text = read_results_file(path)
    for key, render, needs in SECTIONS:
        whole = needs is None or needs.endswith("*")  # the renderer takes all results
        if needs is not None and needs.rstrip("*") not in results:
            continue
        text = update_section(text, key, render(results if whole else results[needs]),
                              first=key == "summary")
    with open(path, "w") as f:
        f.write(text)
