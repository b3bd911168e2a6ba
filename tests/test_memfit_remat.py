"""MemFit's rung after splitting: layers recomputed in the backward pass (rematerialization).

The reference is always plain Keras: `model.fit` without MemFit, from the
same initial weights and seed. Without memory pressure, `MemFit(remat=[...])`
recomputes the named blocks from the first batch and must train as plain
`fit` does, dropout and BatchNormalization included (the recomputation must
draw the forward pass's dropout masks and update the moving statistics
once: recomputing a block without passing its seed state in gives weights
about 1e-2 away, which these tests catch). Under a real OOM (TensorFlow's
capped allocator), one sample of a transformer does not fit, `MemFit()`
recomputes blocks until it does, and trains as the uncapped plain `fit`.

Run directly, this file is the training script of the real-OOM test:
`python tests/test_memfit_remat.py {auto,off,plain} OUT`.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

import keras
from keras import layers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from keras_memfit import MemFit  # noqa: E402
from keras_memfit import backend as _backend  # noqa: E402
from keras_memfit.training.remat import Rematerialization, blocks  # noqa: E402

# Recomputation changes how XLA fuses JAX's step: the same update up to rounding.
# Without memory pressure the models train with SGD: Adam turns the rounding
# noise of weights whose gradient is zero in theory (a key bias, a bias
# before BatchNormalization) into steps of the learning rate's size.
TOL = dict(rtol=1e-4, atol=2e-5) if keras.backend.backend() == "jax" else dict(rtol=1e-5, atol=1e-6)


class Block(layers.Layer):
    """A transformer block with dropout (and, optionally, BatchNormalization)."""

    def __init__(self, dim: int, batch_norm: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.attention = layers.MultiHeadAttention(4, dim // 4, dropout=0.1)
        self.dropout = layers.Dropout(0.2)
        self.hidden = layers.Dense(4 * dim, activation="gelu")
        self.out = layers.Dense(dim)
        self.norm1 = layers.LayerNormalization()
        self.norm2 = layers.LayerNormalization()
        self.batch_norm = layers.BatchNormalization() if batch_norm else None

    def call(self, x, training=None):
        h = self.attention(x, x, use_causal_mask=True, training=training)
        x = self.norm1(x + self.dropout(h, training=training))
        h = self.out(self.hidden(x))
        if self.batch_norm is not None:
            h = self.batch_norm(h, training=training)
        return self.norm2(x + self.dropout(h, training=training))


def transformer(length: int, dim: int, depth: int, batch_norm: bool = False,
                optimizer: str = "adam") -> keras.Model:
    """Token ids -> embedding -> `depth` blocks -> per-token logits."""
    keras.utils.set_random_seed(1)
    tokens = keras.Input((length,), dtype="int32")
    x = layers.Embedding(50, dim, name="embedding")(tokens)
    for i in range(depth):
        x = Block(dim, batch_norm, name=f"block{i}")(x)
    model = keras.Model(tokens, layers.Dense(50, name="logits")(x))
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def _data(rows: int, length: int):
    tokens = np.random.default_rng(0).integers(0, 50, (rows, length)).astype("int32")
    return tokens, np.roll(tokens, -1, axis=1)


def _fit(model, callbacks, batch_size, epochs=2):
    x, y = _data(8, model.input_shape[1])
    keras.utils.set_random_seed(7)
    history = model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False,
                        verbose=0, callbacks=callbacks)
    return [keras.ops.convert_to_numpy(v) for v in model.variables], history.history


def _assert_trained_alike(got, expected):
    (weights, history), (ref_weights, ref_history) = got, expected
    for key, values in ref_history.items():
        np.testing.assert_allclose(history[key], values, err_msg=key, **TOL)
    assert len(weights) == len(ref_weights)
    for w, ref in zip(weights, ref_weights):
        np.testing.assert_allclose(w, ref, **TOL)


@pytest.fixture
def checkpoints(monkeypatch):
    """Counts the functions made with the backend's `checkpoint`."""
    module = _backend.get()
    made = []
    original = module.checkpoint

    def counting(fn):
        made.append(fn)
        return original(fn)

    monkeypatch.setattr(module, "checkpoint", counting)
    return made


@pytest.mark.parametrize("batch_norm", [False, True], ids=["dropout", "dropout+batchnorm"])
def test_forced_remat_trains_as_plain_fit(batch_norm, checkpoints):
    reference = _fit(transformer(16, 16, 2, batch_norm, "sgd"), [], batch_size=4)
    model = transformer(16, 16, 2, batch_norm, "sgd")
    got = _fit(model, [MemFit(remat=["block0", "block1"])], batch_size=4)
    assert checkpoints, "no layer was recomputed"
    _assert_trained_alike(got, reference)
    assert all("call" not in vars(layer) for layer in model.layers), "calls not put back"


def test_without_memory_pressure_nothing_is_recomputed_or_analysed(checkpoints):
    from keras_memfit.training import remat as _remat

    reference = _fit(transformer(16, 16, 2, optimizer="sgd"), [], batch_size=4)
    model = transformer(16, 16, 2, optimizer="sgd")
    memfit = MemFit()  # remat="auto"
    got = _fit(model, [memfit], batch_size=4)
    assert checkpoints == [] and model not in _remat._BLOCKS and memfit.events == []
    _assert_trained_alike(got, reference)


def test_blocks_rank_the_transformer_blocks_first():
    model = transformer(32, 16, 3)
    found, flops = blocks(model)
    assert sorted(b.layer.name for b in found[:3]) == ["block0", "block1", "block2"]
    assert found[0].saving > 0 and flops > 0


def test_memory_report_shows_what_recomputing_frees():
    from keras_memfit import memory_report

    report = memory_report(transformer(64, 16, 2), batch_size=4)
    frees = {row.name: row.remat_bytes for row in report.rows}
    assert frees["block0"] > 0 and frees["block0"] == frees["block1"]
    assert frees["embedding"] == 0 and frees["logits"] == 0  # nothing inside to recompute
    assert "Remat frees" in str(report)


def test_escalation_doubles_until_every_block():
    model = transformer(16, 16, 3)
    remat = Rematerialization(model, "auto")
    counts = []
    while remat.escalate("sig"):
        counts.append(len(remat.names("sig")))
    assert counts[:2] == [1, 2] and counts[-1] == len(blocks(model)[0])
    assert remat.apply("other") == ()  # per signature
    assert not Rematerialization(model, False).escalate("sig")


@pytest.mark.parametrize("remat", ["always", True, [], [3], "block0"])
def test_remat_argument_is_checked(remat):
    with pytest.raises(ValueError, match="remat must be"):
        MemFit(remat=remat)


def test_unknown_layer_name_is_named():
    model = transformer(16, 16, 1)
    with pytest.raises(ValueError, match="nope"):
        _fit(model, [MemFit(remat=["nope"])], batch_size=4, epochs=1)


# ------------------------------------------------------------- real OOMs
# Per backend: the sequence length, and how memory runs out. TensorFlow: the
# capped BFC allocator (one sample: ~259 MiB plain, ~83 with every block
# recomputed). JAX and torch: an address-space limit set in the child once the
# model is built, at what it maps then plus a budget (so TensorFlow's own
# mappings, where Keras imports it, do not count).
LENGTH = {"tensorflow": 1024, "jax": 2048, "torch": 2048}
DIM = {"tensorflow": 128, "jax": 64, "torch": 64}
DEPTH = 4
CAP_MB = 180
BUDGET_MB = {"jax": 1280, "torch": 900}


def test_one_sample_that_does_not_fit_trains_as_plain_fit(tmp_path):
    """MemFit recomputes blocks until one sample fits, and trains as plain `fit` uncapped."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.child import run_child

    backend = keras.backend.backend()

    def run(mode):
        env = {k: v for k, v in os.environ.items() if not k.startswith("TF_CPU_")}
        env.update(TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="2",
                   KERAS_BACKEND=backend, PYTHONPATH=ROOT)
        if mode == "auto" and backend == "tensorflow":
            env.update(TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPU_BFC_MEM_LIMIT_IN_MB=str(CAP_MB))
        out = str(tmp_path / mode)
        proc = run_child([os.path.abspath(__file__), mode, out], env=env, timeout=500)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        with open(out + ".json") as f:
            result = json.load(f)
        with np.load(out + ".npz") as arrays:
            weights = [arrays[f"w{i}"] for i in range(len(arrays.files))]
        return weights, result

    with ThreadPoolExecutor(2) as pool:  # the reference runs while the capped run waits
        capped, plain = pool.map(run, ["auto", "plain"])
    (weights, got), (ref_weights, expected) = capped, plain
    remat = [e for e in got["events"] if e["kind"] == "remat"]
    assert remat and remat[-1]["layers"], got["events"]
    assert got["history"]["memfit_remat"] == [len(remat[-1]["layers"])]
    _assert_trained_alike((weights, got["history"]), (ref_weights, expected["history"]))
    if backend == "tensorflow":  # without the rung MemFit gives up; with all of it too, here
        assert got["off"].startswith("OutOfMemoryError"), got["off"]
        assert "already recomputed 4 layer(s)" in got["all"], got["all"]


def _limit_memory(backend: str) -> None:
    """Where memory is limited by address space: what is mapped now plus the budget."""
    if backend not in BUDGET_MB:
        return
    import resource

    with open("/proc/self/status") as f:
        mapped = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize"))
    limit = mapped + BUDGET_MB[backend] * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _main(mode: str, out: str) -> None:
    """Train one sample per batch; write weights, History and events (`mode` "auto":
    under the memory limit; on TensorFlow after trying `MemFit(remat=False)` there,
    and every block recomputed at twice the length)."""
    from keras_memfit import OutOfMemoryError

    backend = keras.backend.backend()
    length, dim = LENGTH[backend], DIM[backend]
    x, y = _data(2 if backend == "tensorflow" else 1, length)
    model = transformer(length, dim, DEPTH)
    keras.utils.set_random_seed(7)
    result = {}
    if mode == "auto":
        _limit_memory(backend)
    if mode == "auto" and backend == "tensorflow":
        off = transformer(length, dim, DEPTH)
        try:  # without the rung, MemFit gives up
            off.fit(x, y, batch_size=1, verbose=0, callbacks=[MemFit(remat=False)])
            result["off"] = "trained"
        except OutOfMemoryError as err:
            result["off"] = f"OutOfMemoryError: {err}"
        big = transformer(length * 2, dim, DEPTH)  # too long with every block recomputed
        try:
            big.fit(np.tile(x, 2), np.tile(y, 2), batch_size=1, verbose=0,
                    callbacks=[MemFit(remat=[f"block{i}" for i in range(DEPTH)])])
            result["all"] = "trained"
        except OutOfMemoryError as err:
            result["all"] = str(err)
        del off, big
    memfit = MemFit()
    keras.utils.set_random_seed(7)
    history = model.fit(x, y, batch_size=1, epochs=1, shuffle=False, verbose=0,
                        callbacks=[memfit] if mode == "auto" else [])
    result.update(history=history.history, events=memfit.events)
    np.savez(out + ".npz", **{f"w{i}": keras.ops.convert_to_numpy(v)
                              for i, v in enumerate(model.variables)})
    with open(out + ".json", "w") as f:
        json.dump(result, f, default=str)


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
