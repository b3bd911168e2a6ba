"""MemFit and safe_predict across two JAX processes, one of them out of memory.

Two processes on 127.0.0.1 (`tests/processes_support.py`), each feeding its
own rows (`DataParallel` with `auto_shard_dataset = False`). Process 1's
address space is limited so that its full batch runs out of memory (a real
`RESOURCE_EXHAUSTED`) and process 0's is not: MemFit must catch the OOM on
process 1, both must finish with the same weights, equal to one plain Keras
process trained on the same global batches (SGD: nothing amplifies the
summation order's rounding), with the same `iterations` and History; also
with two local devices a process (`TWO_DEVICES`), each piece then laid out
over both, half its rows each. A process that fails with another error, or
dies, must make the other exit with a clear error within the agreement's
timeout.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

from tests.jax_support import requires_jax
from tests.processes_support import describe, run_processes, run_reference

pytestmark = requires_jax

ROWS = 4096  # one process's rows per batch (the global batch: twice that)
BATCHES = 2
EPOCHS = 2
MARGIN_MB = 300  # process 1's address space: its use before fit plus this
TIMEOUT_S = "20"  # KERAS_MEMFIT_PROCESS_TIMEOUT in the failure tests
TWO_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
ODD = 5  # rows a process in the two-device test's last batch: not a multiple of 2


def _data(process):
    """Process `process`'s rows: BATCHES batches of ROWS, seeded per process."""
    rng = np.random.default_rng(10 + process)
    x = rng.random((ROWS * BATCHES, 8), dtype=np.float32)
    return x, rng.integers(0, 3, ROWS * BATCHES)


def _global_batches():
    """The global batches as one process would see them: each batch is process 0's
    rows of it, then process 1's."""
    (x0, y0), (x1, y1) = _data(0), _data(1)
    xs, ys = [], []
    for b in range(BATCHES):
        part = slice(b * ROWS, (b + 1) * ROWS)
        xs += [x0[part], x1[part]]
        ys += [y0[part], y1[part]]
    return np.concatenate(xs), np.concatenate(ys)


def _distribute():
    import keras

    distribution = keras.distribution.DataParallel()
    distribution.auto_shard_dataset = False  # each process feeds its own rows
    keras.distribution.set_distribution(distribution)


class _Counter:
    """Counts keras_memfit's "out of memory" warnings."""

    def __init__(self):
        import logging

        class Handler(logging.Handler):
            ooms = 0

            def emit(self, record):
                Handler.ooms += "out of memory" in record.getMessage()

        self.handler = Handler(logging.WARNING)
        logging.getLogger("keras_memfit").addHandler(self.handler)

    @property
    def ooms(self):
        return self.handler.ooms


def _save(out, name, model, **extra):
    arrays = {f"w{i}": w for i, w in enumerate(model.get_weights())}
    arrays["iterations"] = np.asarray(int(model.optimizer.iterations.value))
    np.savez(os.path.join(out, name), **arrays, **extra)


def _limit_if(process):
    from tests.jax_support import hide_address_space_limit
    from tests.processes_support import limit_address_space

    if process == 1:
        hide_address_space_limit()  # the planner must meet the OOM, not plan around it
        limit_address_space(MARGIN_MB)


def _spy_on_layouts():
    """Record, for each piece MemFit's accumulator puts on the local devices, its rows
    and the rows each device holds (`distribution.put`, which it calls per piece)."""
    import keras

    from keras_memfit.backend.jax import distribution

    put, seen = distribution.put, []

    def spy(data, sharding):
        placed = put(data, sharding)
        first = next(leaf for leaf in keras.tree.flatten(placed) if leaf is not None)
        seen.append([int(first.shape[0])] + sorted(
            int(shard.data.shape[0]) for shard in first.addressable_shards))
        return placed

    distribution.put = spy
    return seen


# ------------------------------------------------------------------ children
def child_fit(process, out, name="fit"):
    import keras_memfit
    from tests.jax_support import real_oom_model

    _distribute()
    model = real_oom_model()
    x, y = _data(process)
    counter = _Counter()
    _limit_if(process)
    history = model.fit(x, y, batch_size=ROWS, epochs=EPOCHS, shuffle=False, verbose=0,
                        callbacks=[keras_memfit.MemFit()]).history
    _save(out, f"{name}{process}.npz", model, loss=np.asarray(history["loss"]),
          accuracy=np.asarray(history["accuracy"]))
    with open(os.path.join(out, f"{name}{process}.json"), "w") as f:
        json.dump({"ooms": counter.ooms}, f)
    # One update per piece cannot be agreed on: refused before any step, by name.
    import pytest

    with pytest.raises(NotImplementedError, match=r"across 2 processes.*mode='shrink'"):
        model.fit(x, y, batch_size=ROWS, epochs=1, verbose=0,
                  callbacks=[keras_memfit.MemFit(mode="shrink")])
    assert int(model.optimizer.iterations.value) == BATCHES * EPOCHS
    return model


def child_fit_two_devices(process, out):
    """`child_fit` with two local devices a process (XLA_FLAGS in `TWO_DEVICES`), then
    one accumulated batch of ODD rows a process: ODD - 1 rows laid out over both
    devices, the last one replicated on both and counted once."""
    import jax

    import keras_memfit.backend

    assert jax.local_device_count() == 2, jax.local_devices()
    seen = _spy_on_layouts()
    model = child_fit(process, out, name="fit2dev")
    with open(os.path.join(out, f"fit2dev{process}.json")) as f:
        found = json.load(f)
    found["pieces"], found["odd_pieces"] = list(seen), []
    _save(out, f"odd_before{process}.npz", model)
    x, y = _data(process)
    seen.clear()
    accumulator = keras_memfit.backend.get().make_accumulator(model)
    accumulator.reset()
    accumulator.add((x[:ODD], y[:ODD], None), 1.0, 1.0)
    accumulator.apply()
    found["odd_pieces"] = seen
    _save(out, f"odd{process}.npz", model)
    with open(os.path.join(out, f"fit2dev{process}.json"), "w") as f:
        json.dump(found, f)


def reference_odd(out):
    """One plain train_on_batch on both processes' ODD rows, from their weights."""
    from tests.jax_support import real_oom_model

    model = real_oom_model()
    with np.load(os.path.join(out, "odd_before0.npz")) as before:
        model.set_weights([before[f"w{i}"] for i in range(len(model.get_weights()))])
    (x0, y0), (x1, y1) = _data(0), _data(1)
    model.train_on_batch(np.concatenate([x0[:ODD], x1[:ODD]]),
                         np.concatenate([y0[:ODD], y1[:ODD]]))
    _save(out, "odd_reference.npz", model)


def reference_fit(out):
    from tests.jax_support import real_oom_model

    model = real_oom_model()
    x, y = _global_batches()
    history = model.fit(x, y, batch_size=2 * ROWS, epochs=EPOCHS, shuffle=False,
                        verbose=0).history
    _save(out, "fit_reference.npz", model, loss=np.asarray(history["loss"]),
          accuracy=np.asarray(history["accuracy"]))


def child_predict(process, out):
    import keras_memfit
    from tests.jax_support import real_oom_model

    _distribute()
    model = real_oom_model()
    x, _ = _data(process)
    counter = _Counter()
    _limit_if(process)
    predictions = keras_memfit.safe_predict(model, x, batch_size=ROWS * BATCHES, verbose=0)
    np.save(os.path.join(out, f"predict{process}.npy"), np.asarray(predictions))
    with open(os.path.join(out, f"predict{process}.json"), "w") as f:
        json.dump({"ooms": counter.ooms}, f)


def reference_predict(out):
    from tests.jax_support import real_oom_model

    model = real_oom_model()
    for process in range(2):
        x, _ = _data(process)
        np.save(os.path.join(out, f"predict_reference{process}.npy"),
                model.predict(x, batch_size=ROWS // 4, verbose=0))


def child_evaluate(process, out):
    import keras_memfit
    from tests.jax_support import real_oom_model

    _distribute()
    model = real_oom_model()
    x, y = _data(process)
    counter = _Counter()
    _limit_if(process)
    logs = keras_memfit.safe_evaluate(model, x, y, batch_size=ROWS * BATCHES, verbose=0,
                                      return_dict=True)
    with open(os.path.join(out, f"evaluate{process}.json"), "w") as f:
        json.dump({"ooms": counter.ooms, "logs": logs}, f)


def reference_evaluate(out):
    from tests.jax_support import real_oom_model

    model = real_oom_model()
    x, y = _global_batches()
    logs = model.evaluate(x, y, batch_size=ROWS // 4, verbose=0, return_dict=True)
    with open(os.path.join(out, "evaluate_reference.json"), "w") as f:
        json.dump(logs, f)


def child_fails(process, out):
    import keras_memfit
    from tests.jax_support import real_oom_model

    _distribute()
    model = real_oom_model()
    x, y = _data(process)
    if process == 1:
        def broken(*args, **kwargs):
            raise ValueError("a bad batch in process 1")

        model.compute_loss_and_updates = broken  # raises inside MemFit's step, once traced
    model.fit(x, y, batch_size=ROWS // 8, epochs=1, shuffle=False, verbose=0,
              callbacks=[keras_memfit.MemFit()])


def child_evaluate_fails(process, out):
    import keras_memfit
    from tests.jax_support import real_oom_model

    _distribute()
    model = real_oom_model()
    x, y = _data(process)
    if process == 1:
        def broken(*args, **kwargs):
            raise ValueError("a bad batch in process 1")

        model.test_step = broken  # raises inside safe_evaluate's step, once traced
    keras_memfit.safe_evaluate(model, x, y, batch_size=ROWS // 8, verbose=0)


def child_dies(process, out):
    import keras

    import keras_memfit
    from tests.jax_support import real_oom_model

    class Die(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if process == 1 and batch == 1:
                os._exit(3)  # no error, no goodbye: as if killed

    _distribute()
    model = real_oom_model()
    x, y = _data(process)
    try:
        model.fit(x, y, batch_size=ROWS // 8, epochs=1, shuffle=False, verbose=0,
                  callbacks=[Die(), keras_memfit.MemFit()])
    except keras_memfit.ProcessFailed as err:
        # JAX's own shutdown at exit would wait for the dead peer until its
        # heartbeat times out (measured: about 80 s more), then abort.
        print(f"{type(err).__name__}: {err}", flush=True)
        os._exit(1)


# --------------------------------------------------------------------- tests
def _load(out, name):
    with np.load(os.path.join(out, name)) as data:
        return {key: data[key] for key in data.files}


def _assert_fit_matches_reference(out, results, name):
    """Process 1 ran out of memory and process 0 did not; both ended with the same
    weights and iterations, equal to one plain process's on the global batches."""
    run_reference(__file__, "reference_fit", out)
    with open(os.path.join(out, f"{name}1.json")) as f:
        assert json.load(f)["ooms"] >= 1, describe(results)  # process 1 ran out of memory
    with open(os.path.join(out, f"{name}0.json")) as f:
        assert json.load(f)["ooms"] == 0, describe(results)  # process 0 did not
    first, second, reference = (_load(out, file) for file in
                                (f"{name}0.npz", f"{name}1.npz", "fit_reference.npz"))
    assert int(first["iterations"]) == int(second["iterations"]) == BATCHES * EPOCHS
    assert int(reference["iterations"]) == BATCHES * EPOCHS
    for key in first:
        np.testing.assert_array_equal(first[key], second[key], err_msg=key)  # identical
        np.testing.assert_allclose(first[key], reference[key], rtol=1e-5, atol=1e-6,
                                   err_msg=key)


def test_memfit_fit_one_process_out_of_memory(tmp_path):
    out = str(tmp_path)
    results = run_processes(__file__, "child_fit", out, timeout=300)
    assert [r.returncode for r in results] == [0, 0], describe(results)
    _assert_fit_matches_reference(out, results, "fit")


def test_memfit_fit_two_local_devices_a_process(tmp_path):
    """Each process lays its pieces over both its devices, half the rows each."""
    out = str(tmp_path)
    results = run_processes(__file__, "child_fit_two_devices", out, timeout=300,
                            env=TWO_DEVICES)
    assert [r.returncode for r in results] == [0, 0], describe(results)
    _assert_fit_matches_reference(out, results, "fit2dev")
    for process in range(2):
        with open(os.path.join(out, f"fit2dev{process}.json")) as f:
            pieces = json.load(f)["pieces"]
        assert pieces, describe(results)
        for rows, *per_device in pieces:  # both devices, an equal share each
            assert per_device == [rows // 2, rows // 2], (process, pieces)
        if process == 1:  # its full batch ran out of memory: smaller pieces followed
            assert min(rows for rows, *_ in pieces) < ROWS, pieces
        with open(os.path.join(out, f"fit2dev{process}.json")) as f:
            odd_pieces = json.load(f)["odd_pieces"]
        assert odd_pieces == [[ODD - 1, ODD // 2, ODD // 2], [1, 1, 1]], odd_pieces
    run_reference(__file__, "reference_odd", out)
    first, second, reference = (_load(out, f"odd{name}.npz") for name in ("0", "1", "_reference"))
    for key in reference:
        if key.startswith("w"):
            np.testing.assert_array_equal(first[key], second[key], err_msg=key)
            np.testing.assert_allclose(first[key], reference[key], rtol=1e-5, atol=1e-6,
                                       err_msg=key)


def test_safe_predict_one_process_out_of_memory(tmp_path):
    out = str(tmp_path)
    results = run_processes(__file__, "child_predict", out, timeout=300)
    assert [r.returncode for r in results] == [0, 0], describe(results)
    run_reference(__file__, "reference_predict", out)
    with open(os.path.join(out, "predict1.json")) as f:
        assert json.load(f)["ooms"] >= 1, describe(results)
    for process in range(2):
        np.testing.assert_allclose(
            np.load(os.path.join(out, f"predict{process}.npy")),
            np.load(os.path.join(out, f"predict_reference{process}.npy")),
            rtol=1e-5, atol=1e-6)


def test_safe_evaluate_one_process_out_of_memory(tmp_path):
    """Both processes report the global metrics, as Keras's multi-process evaluate."""
    out = str(tmp_path)
    results = run_processes(__file__, "child_evaluate", out, timeout=300)
    assert [r.returncode for r in results] == [0, 0], describe(results)
    run_reference(__file__, "reference_evaluate", out)
    found = []
    for process in range(2):
        with open(os.path.join(out, f"evaluate{process}.json")) as f:
            found.append(json.load(f))
    assert found[1]["ooms"] >= 1 and found[0]["ooms"] == 0, describe(results)
    assert found[0]["logs"] == found[1]["logs"]
    with open(os.path.join(out, "evaluate_reference.json")) as f:
        expected = json.load(f)
    assert set(found[0]["logs"]) == set(expected)
    for key, value in expected.items():
        np.testing.assert_allclose(found[0]["logs"][key], value, rtol=1e-5, err_msg=key)


def _assert_clear_failure(results, elapsed, cause):
    assert results[1].returncode != 0, describe(results)
    assert results[0].returncode not in (0, 124, 137), describe(results)  # not killed
    assert "ProcessFailed" in results[0].stdout, describe(results)
    assert cause in results[0].stdout, describe(results)
    assert elapsed < 150, f"took {elapsed:.0f} s\n{describe(results)}"


def test_failing_process_stops_the_other(tmp_path):
    start = time.monotonic()
    results = run_processes(__file__, "child_fails", str(tmp_path), timeout=200,
                            env={"KERAS_MEMFIT_PROCESS_TIMEOUT": TIMEOUT_S})
    elapsed = time.monotonic() - start
    assert "a bad batch in process 1" in results[1].stdout, describe(results)
    _assert_clear_failure(results, elapsed, "process 1 of 2 failed: ValueError('a bad batch")


def test_failing_process_stops_safe_evaluate_of_the_other(tmp_path):
    start = time.monotonic()
    results = run_processes(__file__, "child_evaluate_fails", str(tmp_path), timeout=200,
                            env={"KERAS_MEMFIT_PROCESS_TIMEOUT": "120"})
    elapsed = time.monotonic() - start
    assert "a bad batch in process 1" in results[1].stdout, describe(results)
    _assert_clear_failure(results, elapsed, "process 1 of 2 failed: ValueError('a bad batch")
    assert elapsed < 100, describe(results)  # at once, not after the 120 s timeout


def test_dead_process_stops_the_other(tmp_path):
    start = time.monotonic()
    results = run_processes(__file__, "child_dies", str(tmp_path), timeout=200,
                            env={"KERAS_MEMFIT_PROCESS_TIMEOUT": TIMEOUT_S})
    elapsed = time.monotonic() - start
    assert results[1].returncode == 3, describe(results)
    _assert_clear_failure(results, elapsed, "did not reach keras_memfit's agreement within 20 s")
