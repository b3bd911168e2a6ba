"""MemFit under genuine out-of-memory errors in `model.fit`.

Each scenario trains twice, in two fresh subprocesses started side by side:

- **capped**: the CPU device behind TensorFlow's BFC allocator capped at
  `CAP_MB` MiB (`TF_CPU_ALLOCATOR_USE_BFC`, `TF_CPU_BFC_MEM_LIMIT_IN_MB`, set
  before TensorFlow is imported), `model.fit(..., callbacks=[MemFit()])`, where
  a batch really fails with TensorFlow's own `ResourceExhaustedError`;
- **reference**: the same script with the same seed, uncapped and with plain
  `model.fit` (no MemFit at all), so the expectation is independent of
  keras_memfit.

The test then checks that the capped MemFit run trained like the reference
(final weights, every History entry the reference has, `optimizer.iterations`)
within rtol=1e-5, atol=1e-6, and that it really paid an OOM where the scenario
puts one (without an OOM the comparison proves nothing). oneDNN is off in both
runs (it crashes under the cap), so both use the same kernels. No Dropout or
BatchNormalization: those are not exact under micro-batching, by nature (see
`keras_memfit.callbacks`).

Float64 where batches are accumulated. In float32 this CNN's training is
only reproducible to about 1e-5: the gradients of the second convolution's
bias and kernel are sums over ~10^5-10^6 positions, and summing them in a
different order (one batch vs. the same batch in pieces) moves them by up to
1e-4 relative. Measured on the shape-change scenario: plain float32 fit vs.
the same fit in float64 from the same initial weights differs by up to 2.5e-5
(SGD with momentum; 1.6e-6 with Adam), and plain float32 fit vs. plain float32
fit with each large batch's gradient summed from two halves by up to 1.8e-5,
both failing the tolerance above on a dozen weights; in float64 the same split
changes the weights by less than 1e-13. So the scenarios that accumulate
micro-batches train in float64, where "the same up to float rounding" can be
checked at the tight tolerance; the validation-only scenario, whose training
batches are never split, stays in float32.

Memory (peak of the uncapped BFC allocator) of the CNN below, training:
float64, 28x28 images: ~175 MiB at batch 256, ~535 MiB at batch 1024; 56x56
images at batch 256: ~560 MiB (~450 at 200). float32 `evaluate` of 28x28 images at batch
2048: ~390 MiB; training at batch 64: ~70 MiB. Under `CAP_MB` = 280 the small
batches fit and the large ones do not. Each real OOM costs about 10 s (the
allocator waits for memory before it gives up); each scenario pays one, plus
one for plain `fit` under the cap in the first scenario.

Run directly, this file is the training script the tests start:
`python tests/test_real_oom_fit.py SCENARIO {memfit,plain} OUT_PREFIX`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CAP_MB = 280
TOL = dict(rtol=1e-5, atol=1e-6)
OOM_MARK = "out of memory at batch_size="

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("tensorflow") is None
        or importlib.util.find_spec("keras") is None,
        reason="needs TensorFlow and Keras",
    ),
    # Its children run Keras on TensorFlow behind the capped BFC allocator,
    # whatever the suite's backend (JAX's: tests/test_jax_real_oom.py).
    pytest.mark.tensorflow(reason="real OOMs of TensorFlow's capped BFC allocator"),
]


# ------------------------------------------------------------ parent side
def _env(capped: bool) -> dict:
    env = {
        k: v for k, v in os.environ.items()
        if not k.startswith("TF_CPU_") and k != "KERAS_MEMFIT_TEST_CAPPED"
    }
    env.update(
        TF_ENABLE_ONEDNN_OPTS="0",  # in both runs: the same kernels
        TF_CPP_MIN_LOG_LEVEL="2",
        KERAS_BACKEND="tensorflow",
        PYTHONPATH=os.pathsep.join(
            p for p in (ROOT, os.environ.get("PYTHONPATH")) if p
        ),
    )
    if capped:
        env.update(TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPU_BFC_MEM_LIMIT_IN_MB=str(CAP_MB))
    return env


def train_both(scenario: str, tmp_path):
    """Run `scenario` capped with MemFit and uncapped plain, side by side.

    The reference computes while the capped run waits out its OOMs, so the
    pair costs little more than the capped run alone.

    Returns:
        (capped, reference) results, as `_load` returns them.
    """
    runs = {}
    try:
        for mode, capped in (("memfit", True), ("plain", False)):
            prefix = str(tmp_path / f"{scenario}-{mode}")
            proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), scenario, mode, prefix],
                cwd=ROOT, env=_env(capped), stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True,
            )
            runs[mode] = (proc, prefix)
        results = {}
        for mode, (proc, prefix) in runs.items():
            try:
                output, _ = proc.communicate(timeout=300)
            except subprocess.TimeoutExpired:
                proc.kill()
                output, _ = proc.communicate()
                pytest.fail(f"{scenario} ({mode}) timed out:\n{output[-6000:]}", pytrace=False)
            if proc.returncode != 0:
                pytest.fail(
                    f"{scenario} ({mode}) exited with {proc.returncode}:\n{output[-8000:]}",
                    pytrace=False,
                )
            results[mode] = _load(prefix)
    finally:
        for proc, _ in runs.values():  # the other run, when one failed
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return results["memfit"], results["plain"]


def _load(prefix: str) -> dict:
    with open(prefix + ".json") as f:
        result = json.load(f)
    with np.load(prefix + ".npz") as arrays:
        count = len(arrays.files) // 2
        result["weights"] = [arrays[f"w{i}"] for i in range(count)]
        result["initial"] = [arrays[f"i{i}"] for i in range(count)]
    return result


def assert_same_training(got: dict, ref: dict) -> dict:
    """Same weights, History and optimizer step count as the reference.

    Returns:
        The largest absolute differences found, for the record.
    """
    assert got["iterations"] == ref["iterations"]
    assert len(got["weights"]) == len(ref["weights"])
    for w, r in zip(got["initial"], ref["initial"]):  # the same run, seeded alike
        np.testing.assert_array_equal(w, r)
    diffs = {"weights": 0.0}
    for i, (w, r) in enumerate(zip(got["weights"], ref["weights"])):
        assert w.shape == r.shape and w.dtype == r.dtype, i
        np.testing.assert_allclose(w, r, **TOL, err_msg=f"weight {i}")
        diffs["weights"] = max(diffs["weights"], float(np.max(np.abs(w - r))))
    assert set(ref["history"]) <= set(got["history"])
    for key, values in ref["history"].items():
        np.testing.assert_allclose(got["history"][key], values, **TOL, err_msg=key)
        diffs[key] = float(np.max(np.abs(np.subtract(got["history"][key], values))))
    # The weights moved: the comparison is not between two untouched inits.
    assert max(
        float(np.max(np.abs(w - i))) for w, i in zip(ref["weights"], ref["initial"])
    ) > 1e-3
    return diffs


def ooms(result: dict, phase=None) -> list:
    return [
        e for e in result["events"]
        if e["kind"] == "oom" and (phase is None or e["phase"] == phase)
    ]


# ------------------------------------------------------------------ tests
def test_fit_whose_every_batch_runs_out_of_memory(tmp_path):
    """Batches of 1000 (and a last one of 600) never fit under the cap.

    Plain `fit` with the same batch size under the same cap dies with a real
    ResourceExhaustedError; with MemFit every step is accumulated from
    micro-batch gradients and it trains like the uncapped run: one optimizer
    update per batch.
    """
    got, ref = train_both("every_batch", tmp_path)
    assert ref["plain_under_cap"] is None  # the reference ran uncapped
    assert got["plain_under_cap"] == "ResourceExhaustedError", got["plain_under_cap"]
    assert got["memory_limit_mb"] == CAP_MB
    assert got["dtype"] == ref["dtype"] == "float64"

    train_ooms = ooms(got, "train")
    # The first full batch is tried, fails for real, and is split; the planner
    # then keeps every later batch split without trying it whole again.
    assert len(train_ooms) == 1, got["events"]
    assert (train_ooms[0]["epoch"], train_ooms[0]["step"]) == (0, 0)
    assert train_ooms[0]["old_size"] == 1000 and train_ooms[0]["batch_size"] == 1000
    assert got["oom_warnings"] == [1000]
    assert ooms(got) == train_ooms
    assert got["history"]["memfit_ooms"] == [1, 0]
    assert all(split > 1 for split in got["history"]["memfit_split"])

    assert ref["iterations"] == 6  # 3 batches x 2 epochs, one update each
    diffs = assert_same_training(got, ref)
    print("OOMs:", train_ooms, "splits:", got["history"]["memfit_split"])
    print("diffs vs reference:", diffs)


def test_fit_that_runs_out_of_memory_only_in_validation(tmp_path):
    """Training batches of 64 fit; validation batches of 2048 do not.

    The planner is not told the allocator's limit here: with the limit known,
    validation measures two small pieces and sizes its batches from them
    before trying a big one, and no OOM happens. Hidden, it tries the rest of
    the validation batch whole, which fails for real and is split.
    """
    got, ref = train_both("validation", tmp_path)
    assert got["memory_limit_mb"] is None  # hidden from the planner only

    assert ooms(got, "train") == [], got["events"]
    val_ooms = ooms(got, "evaluate")
    assert 1 <= len(val_ooms) <= 2, got["events"]
    assert val_ooms[0]["epoch"] == 0 and val_ooms[0]["old_size"] > 1024, got["events"]
    # Knowledge is kept: the second epoch's validation pays no OOM.
    assert all(e["epoch"] == 0 for e in val_ooms), got["events"]
    assert len(got["oom_warnings"]) == len(val_ooms)
    assert "val_loss" in ref["history"] and "val_accuracy" in ref["history"]

    assert ref["iterations"] == 2 * 8
    diffs = assert_same_training(got, ref)
    print("OOMs:", val_ooms)
    print("diffs vs reference:", diffs)


def test_fit_that_runs_out_of_memory_mid_epoch_after_a_shape_change(tmp_path):
    """A fully-convolutional model; the dataset's images grow after 3 batches.

    Three batches of 256 images of 28x28 fit; the 4th brings 200 images of
    56x56, three times the activations, and runs out of memory: the step
    fails in the middle of the first epoch, after three that worked, and is
    accumulated, and so is the 5th (150 images of 56x56), without a new OOM.
    """
    got, ref = train_both("shape_change", tmp_path)
    assert got["memory_limit_mb"] == CAP_MB
    assert got["dtype"] == ref["dtype"] == "float64"

    train_ooms = ooms(got, "train")
    assert len(train_ooms) == 1, got["events"]
    assert (train_ooms[0]["epoch"], train_ooms[0]["step"]) == (0, 3), got["events"]
    assert train_ooms[0]["old_size"] == 200
    assert got["oom_warnings"] == [200]
    assert ooms(got) == train_ooms
    assert got["history"]["memfit_ooms"] == [1, 0]
    assert all(split > 1 for split in got["history"]["memfit_split"])

    assert ref["iterations"] == 2 * 5
    diffs = assert_same_training(got, ref)
    print("OOMs:", train_ooms, "splits:", got["history"]["memfit_split"])
    print("diffs vs reference:", diffs)


# ------------------------------------------------------------- child side
def _cnn():
    import keras

    inputs = keras.Input((None, None, 1))
    h = keras.layers.Conv2D(16, 3, activation="relu")(inputs)
    h = keras.layers.Conv2D(32, 3, activation="relu")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    outputs = keras.layers.Dense(10, activation="softmax")(h)
    model = keras.Model(inputs, outputs, name="fcn")
    # SGD, not Adam: its update is linear in the gradient, so a gradient
    # scaled wrongly as a whole shows (Adam's normalisation would hide it).
    model.compile(
        optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model


def _data(n, side, seed, dtype):
    rng = np.random.default_rng(seed)
    x = rng.random((n, side, side, 1), dtype=np.float32)
    # Labels tied to the images, so the model learns something.
    y = (x.mean(axis=(1, 2, 3)) * 10 * 7).astype("int64") % 10
    return x.astype(dtype), y


def _scenario(name):
    """(seed, float dtype, fit arguments) of a scenario."""
    import tensorflow as tf

    if name == "every_batch":
        # Batches of 1000, 1000 and 600 rows: micro-batch weights that are
        # not powers of two, and a last batch of another size.
        x, y = _data(2600, 28, seed=1, dtype="float64")
        return 1, "float64", dict(x=x, y=y, batch_size=1000, epochs=2)
    if name == "validation":
        x, y = _data(8 * 64, 28, seed=2, dtype="float32")
        vx, vy = _data(2048, 28, seed=3, dtype="float32")
        return 2, "float32", dict(
            x=x, y=y, batch_size=64, epochs=2, validation_data=(vx, vy),
            validation_batch_size=2048,
        )
    if name == "shape_change":
        small = _data(3 * 256, 28, seed=4, dtype="float64")
        large = _data(350, 56, seed=5, dtype="float64")
        dataset = tf.data.Dataset.from_tensor_slices(small).batch(256).concatenate(
            tf.data.Dataset.from_tensor_slices(large).batch(200)  # 200, then 150
        )
        return 3, "float64", dict(x=dataset, epochs=2)
    raise ValueError(name)


def _child(name: str, mode: str, prefix: str) -> None:
    import gc
    import logging

    import keras
    import tensorflow as tf

    import keras_memfit
    from keras_memfit.backend import tensorflow as tf_backend

    if name == "validation":
        tf_backend.memory_limit = lambda device: None  # see the test's docstring

    warnings = []

    class Count(logging.Handler):
        def emit(self, record):
            message = record.getMessage()
            if record.levelno >= logging.WARNING and OOM_MARK in message:
                warnings.append(int(message.split(OOM_MARK)[1].split(";")[0]))

    logging.getLogger("keras_memfit").addHandler(Count(logging.WARNING))

    seed, dtype, fit_kwargs = _scenario(name)
    keras.config.set_floatx(dtype)
    keras.utils.set_random_seed(seed)
    model = _cnn()
    model.build((None, None, None, 1))
    initial = [np.array(w) for w in model.get_weights()]
    callbacks = []
    memfit = None
    if mode == "memfit":
        memfit = keras_memfit.MemFit()
        callbacks.append(memfit)
    started = time.time()
    history = model.fit(**fit_kwargs, shuffle=False, verbose=0, callbacks=callbacks)
    seconds = time.time() - started

    limit = tf_backend.memory_limit("CPU:0")
    result = {
        "iterations": int(model.optimizer.iterations.numpy()),
        "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
        "events": memfit.events if memfit else [],
        "oom_warnings": warnings,
        "dtype": model.dtype_policy.variable_dtype,
        "memory_limit_mb": None if limit is None else limit[0] // 2**20,
        "fit_seconds": seconds,
        "plain_under_cap": None,
    }
    np.savez(
        prefix + ".npz",
        **{f"w{i}": w for i, w in enumerate(model.get_weights())},
        **{f"i{i}": w for i, w in enumerate(initial)},
    )

    if name == "every_batch" and os.environ.get("TF_CPU_BFC_MEM_LIMIT_IN_MB"):
        # Plain fit, same model and data, same cap: does it really fail?
        del model, history, memfit
        gc.collect()
        keras.utils.set_random_seed(seed)
        plain = _cnn()
        try:
            plain.fit(**fit_kwargs, shuffle=False, verbose=0)
        except tf.errors.ResourceExhaustedError as exc:
            result["plain_under_cap"] = type(exc).__name__
        else:
            result["plain_under_cap"] = "no error"

    with open(prefix + ".json", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    _child(*sys.argv[1:4])
