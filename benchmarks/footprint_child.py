"""The child side of `benchmarks.footprint`: one measurement in a fresh process.

Run by the parent as `python -m benchmarks.footprint_child LIMIT_GB JSON`,
with Keras's backend (and, on TensorFlow, the capped CPU allocator) in the
environment. On JAX a positive `LIMIT_GB` becomes an address-space limit
(`RLIMIT_AS`) set here before jax starts; that is why this module imports
only the standard library at its top. The child prints one line
`RESULT <json>` (an exception in the measured call is a result too, never a
crash of the child).

Measurements (`JSON["part"]`):

- "try": one width of `Input(1024) -> Dense(W, relu) -> Dense(1024)` (Adam,
  mse): `fit` on two batches, or `predict` on two batches, plain Keras or
  keras_memfit; "ok" says whether the call completed. With `call` "seq",
  "image" or "chain", the width is a sequence length or an image side instead
  (`rung_model`): `fit` on two batches of one sample, plain Keras or
  `MemFit()`, whose one-sample rung may recompute blocks (the blocks it
  ended on are kept in the result).
- "step-time": seconds per training step of one sample at one size, plain
  `fit` against `fit` with `MemFit(remat=[the blocks])`, interleaved, no
  memory pressure: what the one-sample rung costs.
- "peak": the same model with no memory pressure, plain `fit` and MemFit's
  `fit` in one process, interleaved, the allocator's peak around each call.
- "compiles": XLA compilations of the first and second `safe_predict` /
  MemFit `fit` call against the oracle (plain Keras at a batch that fits),
  counted by the backend's own compile events (`Compiles`).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List

FEATURES = 1024
# Under an address-space limit, each Python thread (Keras's callbacks run on a
# thread pool) reserves its stack: 8 MiB by default. Near the widest model,
# plain Keras then failed with "can't start new thread" (JAX, 2026-12-02)
# before any array ran out of memory. 256 KiB is far more than those threads use.
THREAD_STACK = 256 * 2**10
TF_COMPILE_LINE = "Compilation of XLA executable"
"""What TensorFlow's `device_compiler` logs (VLOG 1) once per XLA compilation."""
JAX_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
"""The event JAX records once per backend (XLA) compilation."""


def backend() -> str:
    import keras

    return keras.backend.backend()


# ------------------------------------------------------------------ models
def _jax_initializer():
    """A Glorot-uniform-scaled kernel initializer whose program allocates only its output.

    On JAX, Keras's `GlorotUniform` kernel of K bytes compiles to a program
    with a temporary buffer of 3K (the random bits), and the two kernels'
    initializers run concurrently, asynchronously after the model is built:
    under the address-space limit that, not the call measured, set the widest
    model that predicts, and by a race (measured at W=70,000: the same plain
    `predict` try passed, then failed). This one computes a fixed hash of
    each entry's index in one fused program (no temporary) and is waited for
    before the next weight is made, so the measured call is what fails.
    Plain Keras and keras_memfit get the same weights.
    """
    import jax
    import jax.numpy as jnp
    import keras

    def values(shape, dtype, limit):
        index = jax.lax.broadcasted_iota(jnp.float32, shape, 0)
        for axis in range(1, len(shape)):  # the entry's row-major index
            index = index * shape[axis] + jax.lax.broadcasted_iota(jnp.float32, shape, axis)
        noise = jnp.sin(index * 12.9898 + 78.233) * 43758.5453
        return ((2 * (noise - jnp.floor(noise)) - 1) * limit).astype(dtype)

    compiled = jax.jit(values, static_argnums=(0, 1))

    class HashUniform(keras.initializers.Initializer):
        def __call__(self, shape, dtype=None):
            limit = (6.0 / (shape[0] + shape[-1])) ** 0.5
            out = compiled(tuple(shape), dtype or "float32", limit)
            return jax.block_until_ready(out)

    return HashUniform()


def wide_model(width: int, jit_compile: Any = "auto"):
    """`Input(1024) -> Dense(width, relu) -> Dense(1024)`, Adam, mse, seeded.

    On JAX the kernels come from `_jax_initializer` (see there); on
    TensorFlow from Keras's default `GlorotUniform`.
    """
    import keras

    keras.utils.set_random_seed(0)
    kernel = _jax_initializer() if backend() == "jax" else "glorot_uniform"
    model = keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(width, activation="relu", kernel_initializer=kernel),
        keras.layers.Dense(FEATURES, kernel_initializer=kernel),
    ])
    model.compile(keras.optimizers.Adam(), "mse", jit_compile=jit_compile)
    return model


# The one-sample rung's models: its blocks are top-level layers holding sublayers.
SEQ_DIM, SEQ_HEADS, SEQ_DEPTH, VOCAB = 64, 4, 6, 50
IMAGE_CHANNELS, IMAGE_DEPTH, CLASSES = 8, 8, 10
CHAIN_CHANNELS, CHAIN_DEPTH = 16, 24


def rung_model(kind: str, size: int):
    """The one-sample rung's models at `size`, Adam, seeded; `kind` "seq", "image" or "chain".

    "seq": a decoder-only transformer on `size` tokens (embedding, 6 blocks
    of causal MultiHeadAttention with dropout, a 4x Dense MLP and
    LayerNormalization, d=64, 4 heads). "image": a residual conv stack on a
    `size` x `size` RGB image (a Conv2D(8) stem, 8 residual blocks of a 3x3
    Conv2D(32, relu) and a 1x1 Conv2D(8), global average pooling, Dense(10)):
    the 4x expansion inside a block is what recomputing it frees (with 3x3
    Conv2D(8) pairs, TensorFlow's CPU convolutions' own buffers outweighed it).
    "chain": a functional chain on a `size` x `size` RGB image of 24 blocks of
    a 3x3 Conv2D(16) without bias, BatchNormalization and ReLU, global average
    pooling, Dense(10): no block of its own, the graph is what MemFit cuts (with
    12 blocks, TensorFlow's CPU convolutions' column buffers outweighed what
    recomputing frees).
    """
    import keras
    from keras import layers

    class TransformerBlock(layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.attention = layers.MultiHeadAttention(SEQ_HEADS, SEQ_DIM // SEQ_HEADS,
                                                       dropout=0.1)
            self.dropout = layers.Dropout(0.1)
            self.hidden = layers.Dense(4 * SEQ_DIM, activation="gelu")
            self.out = layers.Dense(SEQ_DIM)
            self.norm1 = layers.LayerNormalization()
            self.norm2 = layers.LayerNormalization()

        def call(self, x, training=None):
            h = self.attention(x, x, use_causal_mask=True, training=training)
            x = self.norm1(x + self.dropout(h, training=training))
            h = self.out(self.hidden(x))
            return self.norm2(x + self.dropout(h, training=training))

    class ResidualBlock(layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.conv1 = layers.Conv2D(4 * IMAGE_CHANNELS, 3, padding="same",
                                       activation="relu")
            self.conv2 = layers.Conv2D(IMAGE_CHANNELS, 1)

        def call(self, x):
            return keras.ops.relu(x + self.conv2(self.conv1(x)))

    keras.utils.set_random_seed(0)  # names fixed: `MemFit(remat=[names])` in another process
    if kind == "seq":
        inputs = keras.Input((size,), dtype="int32")
        x = layers.Embedding(VOCAB, SEQ_DIM, name="embedding")(inputs)
        for i in range(SEQ_DEPTH):
            x = TransformerBlock(name=f"block{i}")(x)
        outputs = layers.Dense(VOCAB, name="logits")(x)
    elif kind == "chain":
        inputs = keras.Input((size, size, 3))
        x = inputs
        for i in range(CHAIN_DEPTH):
            x = layers.Conv2D(CHAIN_CHANNELS, 3, padding="same", use_bias=False,
                              name=f"conv{i}")(x)
            x = layers.ReLU(name=f"relu{i}")(layers.BatchNormalization(name=f"norm{i}")(x))
        x = layers.GlobalAveragePooling2D(name="pool")(x)
        outputs = layers.Dense(CLASSES, name="logits")(x)
    else:
        inputs = keras.Input((size, size, 3))
        x = layers.Conv2D(IMAGE_CHANNELS, 3, padding="same", activation="relu",
                          name="stem")(inputs)
        for i in range(IMAGE_DEPTH):
            x = ResidualBlock(name=f"block{i}")(x)
        x = layers.GlobalAveragePooling2D(name="pool")(x)
        outputs = layers.Dense(CLASSES, name="logits")(x)
    model = keras.Model(inputs, outputs)
    model.compile(keras.optimizers.Adam(),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def rung_data(kind: str, size: int, rows: int):
    import numpy as np

    rng = np.random.default_rng(0)
    if kind == "seq":
        tokens = rng.integers(0, VOCAB, (rows, size)).astype("int32")
        return tokens, np.roll(tokens, -1, axis=1)
    return (rng.random((rows, size, size, 3), dtype=np.float32),
            rng.integers(0, CLASSES, rows))


def wide_data(rows: int):
    import numpy as np

    rng = np.random.default_rng(0)
    return (rng.random((rows, FEATURES), dtype=np.float32),
            rng.random((rows, FEATURES), dtype=np.float32))


def _surface(model) -> None:
    """Wait for the model's variables (JAX: an asynchronous failure surfaces here).

    On JAX it waits on the arrays without copying them to the host
    (`get_weights()` would hold a NumPy copy of every weight, which the
    address-space limit counts: measured, plain `predict` at W=160,000 then
    failed in `get_weights`); on TensorFlow it reads the weights back.
    """
    if backend() == "jax":
        import jax

        jax.block_until_ready([v.value for v in model.variables])
        return
    model.get_weights()


def part_try(config: Dict[str, Any]) -> Dict[str, Any]:
    """One width tried: does `fit` (or `predict`) complete, plain or keras_memfit?"""
    import keras_memfit
    from benchmarks.jobs import OomCounter

    width, batch, memfit = config["width"], config["batch"], config["memfit"]
    call = config["call"]
    callback = keras_memfit.MemFit()
    start = time.perf_counter()
    with OomCounter() as counter:
        try:
            if call in ("seq", "image", "chain"):
                model = rung_model(call, width)
                x, y = rung_data(call, width, 2 * batch)
            else:
                model = wide_model(width, config.get("jit_compile", "auto"))
                x, y = wide_data(2 * batch)
            if call != "predict":
                model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0,
                          callbacks=[callback] if memfit else [])
                _surface(model)
            elif memfit:
                keras_memfit.safe_predict(model, x, batch_size=batch, verbose=0)
                _surface(model)
            else:
                model.predict(x, batch_size=batch, verbose=0)
                _surface(model)
        except Exception as err:  # noqa: BLE001 - the outcome being measured
            return {"ok": False, "error": type(err).__name__,
                    "oom": bool(keras_memfit.is_oom_error(err)),
                    "detail": str(err).strip().splitlines()[0][:200] if str(err) else "",
                    "ooms_caught": counter.count, "seconds": time.perf_counter() - start,
                    **_rung(callback)}
    return {"ok": True, "ooms_caught": counter.count, "seconds": time.perf_counter() - start,
            **_rung(callback)}


def _rung(callback) -> Dict[str, Any]:
    """The blocks MemFit's one-sample rung ended on, and its step-time estimate."""
    events = [e for e in callback.events if e["kind"] == "remat"]
    if not events:
        return {}
    return {"remat_layers": list(events[-1]["layers"]), "remat_estimate": events[-1]["step_time"]}


def part_step_time(config: Dict[str, Any]) -> Dict[str, Any]:
    """Seconds per one-sample step, plain `fit` against `fit` recomputing `layers`.

    Each model's first `fit` (which traces and compiles) is not timed; then
    `rounds` rounds of `fit` on `steps` samples each, the two alternating
    which goes first; the medians over the rounds.
    """
    import statistics

    import keras_memfit

    kind, size, steps = config["call"], config["width"], config["steps"]
    x, y = rung_data(kind, size, steps)
    variants = {"plain": (rung_model(kind, size), list),
                "memfit": (rung_model(kind, size),
                           lambda: [keras_memfit.MemFit(remat=config["layers"])])}
    times: Dict[str, List[float]] = {name: [] for name in variants}
    for r in range(config["rounds"] + 1):  # round 0: the first fit of each, not timed
        for name in variants if r % 2 == 0 else list(variants)[::-1]:
            model, callbacks = variants[name]
            start = time.perf_counter()
            model.fit(x, y, batch_size=1, epochs=1, shuffle=False, verbose=0,
                      callbacks=callbacks())
            _surface(model)
            if r:
                times[name].append((time.perf_counter() - start) / steps)
    plain, memfit = (statistics.median(times[name]) for name in ("plain", "memfit"))
    return {"ok": True, "plain": plain, "memfit": memfit, "ratio": memfit / plain,
            "width": size, "layers": config["layers"], "times": times}


# -------------------------------------------------------------------- peak
def part_peak(config: Dict[str, Any]) -> Dict[str, Any]:
    """Peak allocator bytes of plain fit and MemFit fit, interleaved, in one process.

    `config["variants"]`: "plain" and/or "memfit" (on JAX one, its peak being
    the process's); `repeats` calls each after the first.
    """
    import keras_memfit

    width, batch, repeats = config["width"], config["batch"], config["repeats"]
    variants = config["variants"]
    stats = _peak_reader()
    if stats is None:
        return {"available": False}
    read, reset = stats
    x, y = wide_data(2 * batch)
    models = {name: wide_model(width) for name in variants}
    runs: Dict[str, List[Dict[str, int]]] = {name: [] for name in variants}
    for r in range(repeats + 1):  # run 0: the first fit, which builds and compiles
        for name in variants if r % 2 == 0 else variants[::-1]:
            callbacks = [keras_memfit.MemFit()] if name == "memfit" else []
            reset()
            before = read()
            models[name].fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0,
                             callbacks=callbacks)
            _surface(models[name])
            after = read()
            runs[name].append({"before": before["current"], "peak": after["peak"],
                               "added": after["peak"] - before["current"]})
    params = sum(int(w.size) for w in models[variants[0]].get_weights())
    return {"available": True, "runs": runs, "param_bytes": 4 * params}


def _torch_baseline() -> int:
    """Address space mapped once torch, Keras and keras_memfit ran a tiny fit (their own)."""
    import keras
    import numpy as np

    import keras_memfit

    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile("adam", "mse")
    model.fit(np.ones((2, 1)), np.ones((2, 1)), verbose=0, callbacks=[keras_memfit.MemFit()])
    keras_memfit.safe_predict(model, np.ones((2, 1)), verbose=0)
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def _torch_peak_reader():
    import torch

    if not torch.cuda.is_available():
        return None

    def read():
        return {"current": torch.cuda.memory_allocated(), "peak": torch.cuda.max_memory_allocated()}

    return read, torch.cuda.reset_peak_memory_stats


def _peak_reader():
    """(read, reset) of the backend's allocator statistics, or None where there are none."""
    if backend() == "torch":
        return _torch_peak_reader()
    if backend() == "tensorflow":
        import tensorflow as tf

        def read():
            return tf.config.experimental.get_memory_info("CPU:0")

        def reset():
            tf.config.experimental.reset_memory_stats("CPU:0")

        try:
            read()
        except ValueError:  # the BFC allocator is off
            return None
        return read, reset
    import jax

    device = jax.devices()[0]
    if not device.memory_stats() or "peak_bytes_in_use" not in device.memory_stats():
        return None

    def read_jax():
        s = device.memory_stats()
        return {"current": s["bytes_in_use"], "peak": s["peak_bytes_in_use"]}

    def reset_jax():  # JAX keeps one peak per process: the parent runs one variant a child
        pass

    return read_jax, reset_jax


# --------------------------------------------------------------- compiles
class Compiles:
    """Counts XLA compilations with the backend's own instruments.

    JAX: a `jax.monitoring` listener on the backend-compile event. TensorFlow:
    stderr (fd 2) goes to a file, where `device_compiler` logs one
    "Compilation of XLA executable" line per compilation (the parent starts
    this child with `TF_CPP_VMODULE=device_compiler=1`, `TF_CPP_MIN_LOG_LEVEL=0`).
    """

    def __init__(self) -> None:
        self.jax = backend() == "jax"
        self._count = 0
        if self.jax:
            from jax import monitoring

            def listen(event: str, duration: float, **kwargs: Any) -> None:
                self._count += event == JAX_COMPILE_EVENT

            monitoring.register_event_duration_secs_listener(listen)
        else:
            sys.stderr.flush()
            self._log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
            os.dup2(self._log.fileno(), 2)

    def count(self) -> int:
        if self.jax:
            return self._count
        with open(self._log.name) as f:
            return f.read().count(TF_COMPILE_LINE)

    def during(self, call: Callable[[], Any]) -> int:
        """Compilations while `call()` runs."""
        before = self.count()
        call()
        return self.count() - before

    def toy(self) -> int:
        """Compilations of a jitted function called at shapes 3, 3 and 4 (expected: 2)."""
        import numpy as np

        xs = [np.ones(n, np.float32) for n in (3, 3, 4)]
        if self.jax:
            import jax

            f = jax.jit(lambda v: (v * 2).sum())
            return self.during(lambda: [f(v).block_until_ready() for v in xs])
        import tensorflow as tf

        g = tf.function(lambda v: tf.reduce_sum(v * 2.0), jit_compile=True,
                        reduce_retracing=True)
        return self.during(lambda: [g(tf.constant(v)).numpy() for v in xs])


def _compile_model(scenario: str):
    """The compile scenarios' model: the seed CNN, or the CPU stand-in on JAX's CPU client."""
    import keras

    keras.utils.set_random_seed(0)
    if scenario == "cnn":
        from keras_memfit.app.demo import build_cnn

        model = build_cnn()
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                      jit_compile=True)
        return model
    model = keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(16384, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"],
                  jit_compile=True)
    return model


def _compile_data(scenario: str, rows: int):
    import numpy as np

    if scenario == "cnn":
        from keras_memfit.app.digits import generate_digits

        images, labels = generate_digits(rows, seed=0)
        return (images[..., None] / np.float32(255)).astype("float32"), labels
    rng = np.random.default_rng(0)
    return rng.random((rows, 8), dtype=np.float32), rng.integers(0, 10, rows)


def part_compiles(config: Dict[str, Any]) -> Dict[str, Any]:
    """Compilations per call: safe_predict and MemFit's fit against their oracles."""
    import numpy as np

    import keras_memfit
    from benchmarks.jobs import OomCounter

    counter = Compiles()
    result: Dict[str, Any] = {"toy": counter.toy()}
    scenario = config["scenario"]
    x, y = _compile_data(scenario, config["predict_rows"])

    def calls(model, call) -> Dict[str, Any]:
        out: Dict[str, Any] = {"compiles": [], "ooms": []}
        for _ in range(2):
            sys.stdout.write("PARTIAL " + json.dumps(result) + "\n")  # survives a crash
            sys.stdout.flush()
            with OomCounter() as ooms:
                before = counter.count()
                try:
                    call(model)
                except Exception as err:  # noqa: BLE001 - reported: the call failed
                    out["error"] = f"{type(err).__name__}: {str(err).strip()[:120]}"
                out["compiles"].append(counter.count() - before)
            out["ooms"].append(ooms.count)
        return out

    groups = config.get("groups", ["predict", "fit"])
    rows, oracle_batch = config["predict_rows"], config["predict_oracle_batch"]
    if "predict" in groups:
        result["predict_oracle"] = calls(_compile_model(scenario), lambda m: np.asarray(
            m.predict(x, batch_size=oracle_batch, verbose=0)))
        result["safe_predict"] = calls(_compile_model(scenario), lambda m: np.asarray(
            keras_memfit.safe_predict(m, x, batch_size=rows, verbose=0)))
    if "fit" not in groups:
        return result
    fit_rows, fit_batch = config["fit_rows"], config["fit_batch"]
    xf, yf = x[:fit_rows], y[:fit_rows]

    def fit(batch: int, callbacks: Callable[[], list]) -> Callable[[Any], Any]:
        def run(model):
            model.fit(xf, yf, batch_size=batch, epochs=1, shuffle=False, verbose=0,
                      callbacks=callbacks())
            _surface(model)
        return run

    result["fit_oracle"] = calls(_compile_model(scenario), fit(config["fit_oracle_batch"], list))
    result["memfit"] = calls(_compile_model(scenario),
                             fit(fit_batch, lambda: [keras_memfit.MemFit()]))
    return result


def part_versions(config: Dict[str, Any]) -> Dict[str, Any]:
    from benchmarks import common

    return common.versions()


PARTS = {"try": part_try, "peak": part_peak, "compiles": part_compiles,
         "step-time": part_step_time, "versions": part_versions}


def main(argv: List[str]) -> int:
    limit_gb, config = float(argv[0]), json.loads(argv[1])
    if limit_gb > 0 and os.environ.get("KERAS_BACKEND") == "jax":
        limit = int(limit_gb * 2**30)  # before jax starts: real, recoverable OOMs
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    elif limit_gb > 0 and os.environ.get("KERAS_BACKEND") == "torch":
        limit = _torch_baseline() + int(limit_gb * 2**30)  # headroom above torch's own
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    if limit_gb > 0 and os.environ.get("KERAS_BACKEND") in ("jax", "torch"):
        threading.stack_size(THREAD_STACK)
    result = PARTS[config["part"]](config)
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
