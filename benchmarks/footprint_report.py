"""The `footprint-<backend>` section of RESULTS.md from `benchmarks.footprint`'s results.

`section(data)` renders one backend's stored results (the dict
`benchmarks.footprint.main` builds and keeps in benchmarks/footprint.json);
`problems(data)` lists what makes them an invalid measurement (a
bisection's own checks, a compile counter that miscounts its toy).
"""

from __future__ import annotations

from typing import Any, Dict, List

from benchmarks import common

TARGET_RATIO = 0.98
TOY_COMPILES = 2  # the toy: one jitted function at shapes 3, 3, 4
LABELS = {"fit": ("model.fit", "model.fit(callbacks=[MemFit()])"),
          "fit-jit": ("model.fit", "model.fit(callbacks=[MemFit()])"),
          "predict": ("model.predict", "safe_predict")}


def _mib(n: float) -> str:
    return f"{n / common.MiB:,.1f} MiB"


def _limit(data: Dict[str, Any]) -> str:
    limit = data["settings"]["limit"]
    if data["backend"] == "tensorflow":
        return f"TensorFlow's capped CPU allocator at {limit:g} MiB"
    if data["backend"] == "torch":
        return (f"an address-space limit (RLIMIT_AS) of {limit:g} GiB above what torch, "
                "Keras and keras_memfit map after a tiny fit (torch's CPU allocator)")
    return (f"an address-space limit (RLIMIT_AS) of {limit:g} GiB on JAX's CPU client "
            "(`MALLOC_ARENA_MAX=1`; kernels from an initializer without temporaries, "
            "waited for one by one; the variables waited for, not copied to the host: "
            "see `benchmarks/footprint_child.py`)")


def _confirm(settings: Dict[str, Any]) -> str:
    """How many fresh tries a width gets before it counts as failing, where more than one."""
    confirm = settings.get("confirm", 1)
    if confirm == 1:
        return ""
    return (f" A width counts as failing after {confirm} fresh tries failed (plain and "
            "keras_memfit alike): plain Keras's edge here is not sharp.")


def _stopped_by(result: Dict[str, Any]) -> str:
    for t in result["tries"]:
        if t["width"] == result["failed"] and not t["ok"]:
            how = t.get("error", "?") + (" (OOM)" if t.get("oom") else "")
            if t.get("ooms_caught"):
                how += f" after {t['ooms_caught']} OOM(s) caught"
            return how
    return "?"


def widest_table(part: str, result: Dict[str, Any], resolution: float) -> List[str]:
    plain_label, memfit_label = LABELS[part]
    lines = [f"| batch_size | {plain_label}: widest W (fails at) | {memfit_label}: widest W "
             "(fails at) | ratio | target | tries (s) | what stopped the narrowest failure "
             "(plain / keras_memfit) |",
             "|---:|---:|---:|---:|:---:|---:|---|"]
    for key in sorted({k.split("/")[0] for k in result if "/" in k}, key=int):
        plain, mine = result[f"{key}/plain"], result[f"{key}/memfit"]
        ratio = mine["widest"] / plain["widest"] if plain["widest"] else float("nan")
        verdict = "pass" if ratio >= TARGET_RATIO else "**MISS**"
        lines.append(
            f"| {key} | {plain['widest']:,} ({plain['failed']:,}) | {mine['widest']:,} "
            f"({mine['failed']:,}) | **{ratio:.3f}** | >= {TARGET_RATIO} {verdict} | "
            f"{len(plain['tries'])} + {len(mine['tries'])} "
            f"({plain['seconds']:.0f} + {mine['seconds']:.0f}) | "
            f"{_stopped_by(plain)} / {_stopped_by(mine)} |")
    return lines


def peak_lines(data: Dict[str, Any], peak: Dict[str, Any]) -> List[str]:
    width = data["settings"]["peak_width"]
    if not peak.get("available"):
        where = ("not available on JAX's CPU client (its devices report no memory "
                 "statistics)" if data["backend"] == "jax" else
                 "not available on torch's CPU (statistics come from CUDA's caching "
                 "allocator)" if data["backend"] == "torch" else
                 f"not available: {peak.get('error', 'the BFC allocator is off')}")
        return [f"W={width}, batch_size 8: peak memory {where}."]
    how = ("`tf.config.experimental.get_memory_info('CPU:0')['peak']`, BFC allocator "
           "capped far above the need, `reset_memory_stats` before each fit, plain and "
           "MemFit interleaved in one process" if data["backend"] == "tensorflow" else
           "`torch.cuda.max_memory_allocated()`, `reset_peak_memory_stats` before each fit, "
           "one variant per process" if data["backend"] == "torch" else
           "`jax.devices()[0].memory_stats()['peak_bytes_in_use']`, one variant per process")
    lines = [f"W={width} (weights {_mib(peak['param_bytes'])}), batch_size 8, two steps; "
             f"{how}. \"added\": peak minus the bytes in use before the call.", "",
             "| fit | plain peak | plain added | MemFit peak | MemFit added | "
             "added ratio MemFit/plain |", "|---|---:|---:|---:|---:|---:|"]
    plain, mine = peak["runs"]["plain"], peak["runs"]["memfit"]
    for i, (p, m) in enumerate(zip(plain, mine)):
        label = "1st (builds the optimizer, compiles)" if i == 0 else f"call {i + 1}"
        ratio = m["added"] / p["added"] if p["added"] else float("nan")
        lines.append(f"| {label} | {_mib(p['peak'])} | {_mib(p['added'])} | "
                     f"{_mib(m['peak'])} | {_mib(m['added'])} | **{ratio:.2f}** |")
    return lines


def compile_lines(data: Dict[str, Any], comp: Dict[str, Any]) -> List[str]:
    crash = []
    if comp.get("error"):  # the child died: what it measured before, then the crash
        crash = ["", f"**The child process died** ({comp['error']}) after the rows above; "
                 f"the call that was running has no row (its stderr ends: "
                 f"`{comp.get('detail', '')[-160:]}`)."]
    if "predict_oracle" not in comp:
        return [f"Not measured: the child failed ({comp.get('error')}: {comp.get('detail')})."]
    tf = data["backend"] == "tensorflow"
    model = ("the seed CNN (`build_cnn`, recompiled with `jit_compile=True`) on generated "
             "digits" if comp["scenario"] == "cnn" else
             "`benchmarks.gpu`'s CPU stand-in, Dense(16384, relu) > Dense(10) on 8 features")
    limit = (f"the capped allocator at {comp['limit']} MiB" if tf
             else f"RLIMIT_AS {comp['limit']:g} GiB")
    counter = ("`device_compiler`'s \"Compilation of XLA executable\" log line "
               "(`TF_CPP_VMODULE=device_compiler=1`)" if tf else
               "`jax.monitoring` events `/jax/core/compile/backend_compile_duration`")
    lines = [f"{model}, under {limit}; XLA compilations counted with {counter}. Counter "
             f"check on a toy jitted function at shapes 3, 3, 4: counted {comp['toy']} "
             f"(expected {TOY_COMPILES}). Each call on a fresh model; the predict calls and "
             "the fit calls each in a fresh process.", "",
             "| call | compilations: 1st call | 2nd call | OOMs caught (1st, 2nd) | "
             "extra over the oracle (1st, 2nd) | target |",
             "|---|---:|---:|---:|---:|---|"]
    rows = [("predict_oracle", f"oracle: `model.predict`, {comp['predict_rows']:,} rows, "
             f"batch_size={comp['predict_oracle_batch']}", None),
            ("safe_predict", f"`safe_predict`, batch_size={comp['predict_rows']:,}",
             "predict_oracle"),
            ("fit_oracle", f"oracle: `model.fit`, {comp['fit_rows']:,} rows, "
             f"batch_size={comp['fit_oracle_batch']}, 1 epoch", None),
            ("memfit", f"`fit` + MemFit, batch_size={comp['fit_batch']:,}", "fit_oracle")]
    for key, label, oracle in rows:
        if key not in comp or (oracle and oracle not in comp):
            continue
        c = comp[key]
        extra, target = "", ""
        if oracle:
            e = [a - b for a, b in zip(c["compiles"], comp[oracle]["compiles"])]
            extra = f"{e[0]:+d}, {e[1]:+d}"
            if key == "safe_predict":
                ok = e[0] <= 1 and c["compiles"][1] == 0
                target = f"1st <= +1, 2nd 0: {'pass' if ok else '**MISS**'}"
            else:
                ok = sum(e) <= 2
                target = f"<= +2 over the fit: {'pass' if ok else '**MISS**'}"
        if c.get("error"):
            target = f"**the call failed**: {c['error']}"
        lines.append(f"| {label} | {c['compiles'][0]} | {c['compiles'][1]} | "
                     f"{c['ooms'][0]}, {c['ooms'][1]} | {extra} | {target} |")
    return lines + crash


def section(data: Dict[str, Any]) -> str:
    """The Markdown section of one backend's results."""
    parts, settings = data["parts"], data["settings"]
    versions = data.get("versions") or {}
    if "ok" in versions:  # the versions child failed: a try-shaped error dict
        versions = {}
    machine = {**data["machine"], **{k: v for k, v in versions.items()
                                     if isinstance(v, str)}}
    lines = [f"## Footprint against plain Keras: the widest model, peak memory, "
             f"compilations ({data['backend']})", "",
             f"Generated by `{data['command'].strip()}` ({data['seconds'] / 60:.1f} min"
             f"{', QUICK configuration' if data['quick'] else ''}). keras_memfit must never "
             "fit less than plain Keras. Model: `Input(1024) -> Dense(W, relu) -> "
             "Dense(1024)`, Adam, mse, default `jit_compile`; each width tried in a fresh "
             f"process under {_limit(data)}. Bisection over W: plain Keras first, "
             "keras_memfit bracketed around plain's result, batch 1 around batch 8's; it "
             f"stops when the widest W that ran and the narrowest that failed are within "
             f"{settings['resolution']:.0%} of W (widths are multiples of 8). A try "
             "\"trains\" when `fit` (two steps: 2 x batch_size rows) returns; MemFit may "
             f"adapt.{_confirm(settings)} See `benchmarks/footprint.py`.", "",
             common.machine_line(machine)]
    for part, title in (("fit", "### Widest model that trains: fit"),
                        ("predict", "### Widest model that predicts: predict "
                                    "(2 x batch_size rows)"),
                        ("fit-jit", "### Widest model that trains under XLA: fit, "
                                    "`jit_compile=True`")):
        if part in parts:
            lines += ["", title, ""] + widest_table(part, parts[part], settings["resolution"])
    if "peak" in parts:
        lines += ["", "### Peak memory with no pressure", ""] + peak_lines(data, parts["peak"])
    if "compiles" in parts:
        lines += ["", "### XLA compilations per call where the batch must adapt", ""]
        lines += compile_lines(data, parts["compiles"])
    found = problems(data)
    if found:
        lines += ["", "**Invalid measurement:**"] + [f"- {p}" for p in found]
    return "\n".join(lines) + "\n"


# MemFit / plain Keras per backend and rung part: the longest sequence (issue #37),
# the widest image of the functional conv chain (issue #47).
RUNG_TARGET = {"tensorflow": {"seq": 1.7, "chain": 1.25}}
RUNG_LIMITS = {"tensorflow": "capped allocator {:g} MiB", "jax": "RLIMIT_AS {:g} GiB",
               "torch": "RLIMIT_AS {:g} GiB above torch's own"}


def _rung_cells(data: Dict[str, Any], part: str) -> List[str]:
    """A rung part's cells: plain / MemFit (fails at), ratio, step time (measured; estimate)."""
    result = data["parts"].get(part)
    if result is None:
        return ["not measured", "", ""]
    plain, mine = result["1/plain"], result["1/memfit"]
    ratio = mine["widest"] / plain["widest"] if plain["widest"] else float("nan")
    ratio_cell = f"**{ratio:.2f}**"
    target = RUNG_TARGET.get(data["backend"], {}).get(part)
    if target:
        ratio_cell += f" (>= {target} {'pass' if ratio >= target else '**MISS**'})"
    timing = result.get("step_time")
    if timing is None:
        time_cell = "nothing recomputed"
    elif not timing.get("ok"):
        time_cell = f"failed: {timing.get('error')}"
    else:
        estimate = result.get("remat_estimate")
        time_cell = (f"x{timing['ratio']:.2f} ({timing['plain']:.2f} -> {timing['memfit']:.2f} s"
                     f"{f'; est. x{estimate:g}' if estimate else ''})")
    blocks = len(result.get("remat_layers") or [])
    return [f"{plain['widest']:,} ({plain['failed']:,}) / {mine['widest']:,} "
            f"({mine['failed']:,}), {blocks} layers recomputed", ratio_cell, time_cell]


def rung_section(stored: Dict[str, Any]) -> str:
    """The `footprint-rung` section: every backend's one-sample rung parts, one table."""
    parts = ("seq", "image", "chain")
    entries = [stored[b] for b in ("tensorflow", "jax", "torch")
               if b in stored and set(stored[b]["parts"]) & set(parts)]
    runs = "; ".join(f"{d['backend']} " + ", ".join(
        f"{p} {d['parts'][p]['date']}" for p in parts if p in d["parts"]) for d in entries)
    lines = ["## One sample that does not fit: MemFit's rung (rematerialization) against plain "
             "Keras", "",
             "Generated by `python -m benchmarks.footprint --backend B --parts seq image chain` "
             f"({runs} UTC; machine as in the footprint sections). At batch_size 1: the longest "
             "sequence a transformer trains on (seq: 6 blocks of causal MultiHeadAttention + 4x "
             "MLP, d=64), the widest square image a residual conv stack trains on (image: 8 "
             "blocks of a 3x3 Conv2D(32) and a 1x1 Conv2D(8)) and the widest a functional chain "
             "trains on (chain: 24 blocks of a 3x3 Conv2D(16), BatchNormalization and ReLU, no "
             "block of its own: MemFit cuts its graph), `fit` on 2 samples, Adam, each size "
             "tried in a fresh process under the limit; bisection to 20% (chain: 5%). Step "
             "time: seconds per one-sample step at plain Keras's largest size, plain `fit` -> "
             "`fit` with `MemFit(remat=[the layers MemFit recomputed at its largest])`, "
             "interleaved, no limit; est.: MemFit's own estimate (`events[...]['step_time']`). "
             "See `benchmarks/footprint.py`.",
             "",
             "| backend (limit) | model | plain / MemFit (fails at) | ratio | step time |",
             "|---|---|---:|---:|---:|"]
    names = {"seq": "seq (tokens)", "image": "image (side)", "chain": "chain (side)"}
    for data in entries:
        for part in parts:
            if part not in data["parts"]:
                continue
            limit = RUNG_LIMITS[data["backend"]].format(data["parts"][part]["limit"])
            cells = [names[part]] + _rung_cells(data, part)
            lines.append(f"| {data['backend']} ({limit}) | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def problems(data: Dict[str, Any]) -> List[str]:
    """What makes the stored results an invalid measurement."""
    found = []
    for part in ("fit", "predict", "fit-jit", "seq", "image", "chain"):
        for key, result in data["parts"].get(part, {}).items():
            if "/" in key:
                found += [f"{part} {key}: {p}" for p in result.get("problems", [])]
    comp = data["parts"].get("compiles")
    if comp is not None and comp.get("toy") != TOY_COMPILES:
        found.append(f"compile counter counted {comp.get('toy')} on its toy, "
                     f"not {TOY_COMPILES}")
    return found
