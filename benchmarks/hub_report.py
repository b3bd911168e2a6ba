"""`memory_report` on KerasHub, keras.applications and keras-rs models (issue 21 item 6).

For each tiny config (random weights, built from config: nothing is
downloaded) a fresh process under TensorFlow's BFC CPU allocator
(`capped_cpu_env`, 8000 MiB: a cap far above the need, for the allocator's
statistics) builds the model, runs `memory_report` for a training and an
inference step at the batch size below, and measures TensorFlow's peak
(`get_memory_info('CPU:0')['peak']` after `reset_memory_stats`, less what
was in use before the model was built) of `train_on_batch` and
`predict_on_batch` at that batch, each after a first call that traces and
builds. Writes the `hub-report` section of benchmarks/RESULTS.md with the
estimate / measured ratios (the README's 0.6-1.2x is for the project's own
models).

Usage: python -m benchmarks.hub_report [--only NAME ...]
(needs keras-hub and keras-rs: pip install -e '.[hub]' keras-rs)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from typing import Any, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "RESULTS.md")
CAP_MB = 8000
SEQ = 128

# name: (what it is, batch size)
MODELS = {
    "gpt2": ("KerasHub GPT2CausalLM: 2 layers, hidden 128, 4 heads, vocabulary 5000, "
             f"{SEQ} tokens (ReversibleEmbedding, cached attention)", 16),
    "gemma": ("KerasHub GemmaCausalLM: 2 layers, hidden 128, 4 query heads / 1 key-value "
              f"head, vocabulary 5000, {SEQ} tokens (no max_sequence_length: "
              f"sequence_length={SEQ} given)", 16),
    "efficientnet": ("keras.applications EfficientNetB0, 64x64x3, 10 classes, Adam", 32),
    "dcn": ("keras-rs DCN: two Embedding(10000, 16) id features + 8 dense, two "
            "keras_rs FeatureCross, Dense(64), Dense(1), Adam", 512),
}


def _build(name: str):
    """(model, x, y, sample_weight, report keywords) for the tiny config `name`."""
    import keras
    import numpy as np

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    batch = MODELS[name][1]
    if name in ("gpt2", "gemma"):
        import keras_hub

        vocab = 5000
        if name == "gpt2":
            backbone = keras_hub.models.GPT2Backbone(
                vocabulary_size=vocab, num_layers=2, num_heads=4, hidden_dim=128,
                intermediate_dim=512, max_sequence_length=SEQ)
            lm = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
        else:
            backbone = keras_hub.models.GemmaBackbone(
                vocabulary_size=vocab, num_layers=2, num_query_heads=4,
                num_key_value_heads=1, hidden_dim=128, intermediate_dim=512, head_dim=32)
            lm = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
        lm.compile(optimizer=keras.optimizers.Adam(1e-3),
                   loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        ids = rng.integers(1, vocab, (batch, SEQ)).astype("int32")
        x = {"token_ids": ids, "padding_mask": np.ones((batch, SEQ), bool)}
        return lm, x, ids, None, {"sequence_length": SEQ}
    if name == "efficientnet":
        model = keras.applications.EfficientNetB0(
            weights=None, input_shape=(64, 64, 3), classes=10)
        model.compile("adam", "sparse_categorical_crossentropy")
        x = rng.random((batch, 64, 64, 3)).astype("float32") * 255
        return model, x, rng.integers(0, 10, batch), None, {}
    import keras_rs

    ids = [keras.Input((), dtype="int32", name=f"id{i}") for i in range(2)]
    dense = keras.Input((8,), name="dense")
    emb = [keras.layers.Embedding(10000, 16)(t) for t in ids]
    x0 = keras.layers.Concatenate()(emb + [dense])
    h = keras_rs.layers.FeatureCross()(x0, x0)
    h = keras_rs.layers.FeatureCross()(x0, h)
    h = keras.layers.Dense(64, activation="relu")(h)
    out = keras.layers.Dense(1, activation="sigmoid")(h)
    model = keras.Model(ids + [dense], out, name="dcn")
    model.compile("adam", "binary_crossentropy")
    x = [rng.integers(0, 10000, batch).astype("int32") for _ in range(2)]
    x.append(rng.random((batch, 8)).astype("float32"))
    return model, x, rng.integers(0, 2, (batch, 1)).astype("float32"), None, {}


def child(name: str) -> Dict[str, Any]:
    """Run in a fresh process: the report's estimates and the measured peaks of `name`."""
    import tensorflow as tf

    from keras_memfit import memory_report

    gc.collect()
    base = tf.config.experimental.get_memory_info("CPU:0")["current"]
    model, x, y, sw, kwargs = _build(name)
    batch = MODELS[name][1]
    result: Dict[str, Any] = {"name": name, "batch": batch}
    for phase, call in (("predict", lambda: model.predict_on_batch(x)),
                        ("train", lambda: model.train_on_batch(x, y, sample_weight=sw))):
        call()  # traces, builds the optimizer
        gc.collect()
        tf.config.experimental.reset_memory_stats("CPU:0")
        call()
        measured = tf.config.experimental.get_memory_info("CPU:0")["peak"] - base
        report = memory_report(model, batch, training=phase == "train", **kwargs)
        result[phase] = {"estimate": int(report.peak_bytes), "measured": int(measured),
                         "ratio": report.peak_bytes / measured}
    return result


def _run_child(name: str) -> Dict[str, Any]:
    from keras_memfit.app.env import capped_cpu_env

    env = dict(os.environ, KERAS_BACKEND="tensorflow", **capped_cpu_env(CAP_MB))
    start = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.hub_report", "--child", name],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"name": name, "error": (proc.stderr or proc.stdout)[-1500:]}
    result = json.loads(lines[-1])
    result["seconds"] = round(time.time() - start, 1)
    return result


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def section(results: List[Dict[str, Any]]) -> str:
    """The `hub-report` section of RESULTS.md."""
    import keras

    versions = {"Keras": keras.__version__}
    for package in ("tensorflow", "keras_hub", "keras_rs"):
        try:
            versions[package] = __import__(package).__version__
        except ImportError:
            versions[package] = "not installed"
    lines = [
        "## memory_report on KerasHub, keras.applications and keras-rs models",
        "",
        "`python -m benchmarks.hub_report`: each tiny config (random weights) in a "
        f"fresh process on TensorFlow's BFC CPU allocator ({CAP_MB} MiB cap), the "
        "report's peak estimate against TensorFlow's measured peak "
        "(`get_memory_info('CPU:0')['peak']` after `reset_memory_stats`, less what "
        "was in use before the model was built) of `predict_on_batch` and "
        "`train_on_batch` at the same batch, after a first call. The README's "
        "0.6x-1.2x is for the project's own models.",
        "",
        "| model | batch | step | estimate | measured | estimate / measured |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['name']} | | failed | | | `{r['error'].splitlines()[-1][:120]}` |")
            continue
        for phase in ("predict", "train"):
            p = r[phase]
            lines.append(f"| {r['name']} | {r['batch']} | {phase} | {_mib(p['estimate'])} | "
                         f"{_mib(p['measured'])} | {p['ratio']:.2f} |")
    lines += ["", "Models:", ""]
    lines += [f"- {name}: {what}, batch {batch}." for name, (what, batch) in MODELS.items()]
    lines += ["", "Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()) + "."]
    return "\n".join(lines) + "\n"


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--only", nargs="*", choices=sorted(MODELS))
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child)))
        return 0
    from benchmarks.common import write_section

    results = [_run_child(name) for name in (args.only or MODELS)]
    for r in results:
        print(json.dumps(r))
    write_section(RESULTS, "hub-report", section(results))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
