"""The Digit Recognizer demo, its generated data and the command line.

- `keras_memfit.app.digits`: shapes, dtypes, determinism, speed, Kaggle's CSV
  formats (train.csv and test.csv read back, submission.csv as written).
- `python -m keras_memfit demo`, end to end in a subprocess: the plain
  `model.fit(batch_size=768)` and `model.predict(x_test, batch_size=28000)`
  really run out of memory under the demo's capped allocator, MemFit trains
  at that batch and `safe_predict` recovers; submission.csv is in Kaggle's
  format with labels that agree with the generated ground truth and with
  those of plain Keras's `fit` of the same model, data and seed here, without
  the cap (both recomputed here, independently of what the demo reports). It
  takes about a minute and a half: three real OOMs (~10 s each), two fits
  and 28,000 predictions on CPU.
- The command line's errors: one line on stderr, a non-zero exit, no traceback.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest
from cli_support import assert_one_line_error, run_cli, to_kaggle_csv

from keras_memfit.app import cli, demo, digits, records
from keras_memfit.app import env as app_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --------------------------------------------------------------------------
# digits: generated data
# --------------------------------------------------------------------------
def test_load_digits_shapes_dtypes_and_ranges():
    x_train, y_train, x_test = digits.load_digits(train_samples=300, test_samples=200, seed=3)
    assert x_train.shape == (300, 28, 28) and x_train.dtype == np.uint8
    assert y_train.shape == (300,) and y_train.dtype == np.int64
    assert x_test.shape == (200, 28, 28) and x_test.dtype == np.uint8
    assert set(np.unique(y_train)) == set(range(10))
    # Every image has ink (a stroke near full brightness) on a mostly dark ground.
    assert (x_train.reshape(300, -1).max(axis=1) >= 180).all()
    assert (np.median(x_train.reshape(300, -1), axis=1) < 40).all()


def test_load_digits_default_sizes_are_kaggles_and_test_labels_on_request():
    assert digits.KAGGLE_TRAIN_SAMPLES == 42000 and digits.KAGGLE_TEST_SAMPLES == 28000
    out = digits.load_digits(train_samples=10, test_samples=20, return_test_labels=True)
    assert len(out) == 4
    assert out[3].shape == (20,) and out[3].dtype == np.int64
    assert out[3].min() >= 0 and out[3].max() <= 9


def test_generation_is_deterministic_by_seed():
    a_images, a_labels = digits.generate_digits(64, seed=7)
    b_images, b_labels = digits.generate_digits(64, seed=7)
    c_images, c_labels = digits.generate_digits(64, seed=8)
    np.testing.assert_array_equal(a_images, b_images)
    np.testing.assert_array_equal(a_labels, b_labels)
    assert not np.array_equal(a_images, c_images)


def test_test_set_does_not_depend_on_the_number_of_training_samples():
    small = digits.load_digits(50, 40, seed=1, return_test_labels=True)
    large = digits.load_digits(500, 40, seed=1, return_test_labels=True)
    np.testing.assert_array_equal(small[2], large[2])
    np.testing.assert_array_equal(small[3], large[3])
    # Train and test are different images.
    assert not np.array_equal(small[0][:40], small[2])


def test_generate_digits_edge_cases_and_bad_counts():
    images, labels = digits.generate_digits(0)
    assert images.shape == (0, 28, 28) and images.dtype == np.uint8 and labels.shape == (0,)
    for bad in (-1, 2.5, True, "10"):
        with pytest.raises(ValueError, match="n must be a non-negative int"):
            digits.generate_digits(bad)
    with pytest.raises(ValueError, match="test_samples"):
        digits.load_digits(10, -5)


def test_generating_kaggles_test_set_takes_seconds_not_minutes():
    start = time.perf_counter()
    images, _ = digits.generate_digits(digits.KAGGLE_TEST_SAMPLES, seed=0)
    elapsed = time.perf_counter() - start
    assert images.shape == (28000, 28, 28)
    assert elapsed < 20, f"generating 28,000 digits took {elapsed:.1f} s"


def test_each_class_is_distinct_on_average():
    images, labels = digits.generate_digits(2000, seed=0)
    means = np.stack([images[labels == d].mean(axis=0).ravel() for d in range(10)])
    distances = np.linalg.norm(means[:, None] - means[None], axis=-1)
    off_diagonal = distances[~np.eye(10, dtype=bool)]
    assert off_diagonal.min() > 200  # no two digit classes share a mean image


# --------------------------------------------------------------------------
# digits: Kaggle's CSV formats
# --------------------------------------------------------------------------
def test_train_csv_round_trip(tmp_path):
    images, labels = digits.generate_digits(25, seed=2)
    path = tmp_path / "train.csv"
    to_kaggle_csv(path, images, labels)
    with open(path) as f:
        header = f.readline().strip().split(",")
        first = f.readline().strip().split(",")
    assert header == ["label"] + [f"pixel{i}" for i in range(784)]
    assert len(first) == 785 and int(first[0]) == labels[0]
    assert [int(v) for v in first[1:]] == images[0].ravel().tolist()
    loaded, loaded_labels = digits.load_kaggle_csv(path)
    assert loaded.dtype == np.uint8 and loaded.shape == (25, 28, 28)
    np.testing.assert_array_equal(loaded, images)
    np.testing.assert_array_equal(loaded_labels, labels)


def test_test_csv_round_trip_without_labels(tmp_path):
    images, _ = digits.generate_digits(12, seed=4)
    path = tmp_path / "test.csv"
    to_kaggle_csv(str(path), images.reshape(12, 784))
    with open(path) as f:
        assert f.readline().strip() == ",".join(f"pixel{i}" for i in range(784))
    loaded, labels = digits.load_kaggle_csv(path)
    assert labels is None
    np.testing.assert_array_equal(loaded, images)


def test_load_kaggle_csv_rejects_other_files(tmp_path):
    bad_header = tmp_path / "bad_header.csv"
    bad_header.write_text("id,value\n1,2\n")
    with pytest.raises(ValueError, match="not a Digit Recognizer CSV"):
        digits.load_kaggle_csv(bad_header)
    short_row = tmp_path / "short_row.csv"
    images, _ = digits.generate_digits(2, seed=0)
    to_kaggle_csv(short_row, images)
    text = short_row.read_text().splitlines()
    short_row.write_text("\n".join(text[:-1] + [text[-1].rsplit(",", 1)[0]]) + "\n")
    with pytest.raises(ValueError, match="784 integer columns"):
        digits.load_kaggle_csv(short_row)


def test_write_submission(tmp_path):
    path = tmp_path / "submission.csv"
    labels = np.array([3, 0, 9, 9, 1], np.int32)
    digits.write_submission(path, labels)
    assert path.read_text() == "ImageId,Label\n1,3\n2,0\n3,9\n4,9\n5,1\n"
    with pytest.raises(ValueError, match="digits 0..9"):
        digits.write_submission(path, np.array([1, -1]))
    with pytest.raises(ValueError, match="one-dimensional"):
        digits.write_submission(path, np.zeros((2, 10), np.int64))


# --------------------------------------------------------------------------
# demo helpers (no subprocess)
# --------------------------------------------------------------------------
def test_worker_environment_caps_the_cpu_allocator_or_leaves_it_for_the_gpu():
    base = {"PATH": "/bin", "TF_CPU_BFC_MEM_LIMIT_IN_MB": "9", "PYTHONPATH": "/x"}
    cpu = app_env.worker_environment("cpu", 400, base)
    assert cpu["TF_CPU_ALLOCATOR_USE_BFC"] == "true"
    assert cpu["TF_CPU_BFC_MEM_LIMIT_IN_MB"] == "400"
    assert cpu["TF_ENABLE_ONEDNN_OPTS"] == "0"
    assert cpu["CUDA_VISIBLE_DEVICES"] == "-1"
    assert cpu["PYTHONPATH"].split(os.pathsep) == [ROOT, "/x"]
    gpu = app_env.worker_environment("gpu", 1024, base)
    assert "TF_CPU_BFC_MEM_LIMIT_IN_MB" not in gpu and "TF_CPU_ALLOCATOR_USE_BFC" not in gpu
    assert base["TF_CPU_BFC_MEM_LIMIT_IN_MB"] == "9"  # not modified
    with pytest.raises(ValueError, match="device"):
        app_env.worker_environment("tpu", 1)


def test_describe_sizes_run_length_encodes():
    assert records.describe_sizes([16, 64, 655, 655, 655, 410]) == "16, 64, 655 x 3, 410"
    assert records.describe_sizes([]) == ""


def test_run_demo_rejects_bad_arguments_before_starting_a_worker(tmp_path):
    output = tmp_path / "s.csv"
    with pytest.raises(ValueError, match="at least 300"):
        demo.run_demo(output, memory_limit_mb=100, device="cpu")
    with pytest.raises(ValueError, match="epochs"):
        demo.run_demo(output, epochs=0)
    with pytest.raises(ValueError, match="device"):
        demo.run_demo(output, device="tpu")
    with pytest.raises(demo.DemoError, match="does not exist"):
        demo.run_demo(tmp_path / "missing" / "s.csv")
    assert not output.exists()


# --------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv, code, pattern",
    [
        ([], 2, r"required: COMMAND"),
        (["nope"], 2, r"invalid choice: 'nope'"),
        (["demo", "--memory-limit", "lots"], 2, r"--memory-limit: expected an integer >= 1"),
        (["demo", "--epochs", "0"], 2, r"--epochs: expected an integer >= 1, got '0'"),
        (["demo", "--train-samples", "5"], 2, r"--train-samples: expected an integer >= 100"),
        (["demo", "--device", "cpu", "--memory-limit", "100"], 2, r"at least 300"),
        (["demo", "--output", "/no/such/folder/s.csv"], 1, r"folder /no/such/folder does not exist"),
    ],
)
def test_cli_errors_are_one_line(capsys, argv, code, pattern):
    assert_one_line_error(capsys, argv, code, pattern)


def test_cli_help_exits_zero(capsys):
    assert cli.main(["demo", "--help"]) == 0
    out = capsys.readouterr().out
    for option in ("--output", "--memory-limit", "--epochs", "--train-samples", "--quiet"):
        assert option in out


def test_cli_bad_argument_in_a_subprocess_is_one_line_without_traceback():
    # TensorFlow prints a start-up banner on stderr when `import keras_memfit`
    # imports it (before the command line runs); these two variables silence it.
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_ENABLE_ONEDNN_OPTS="0")
    result = subprocess.run(
        [sys.executable, "-m", "keras_memfit", "demo", "--epochs", "-3"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines == ["keras-memfit: error: argument --epochs: expected an integer >= 1, "
                     "got '-3' (see 'keras-memfit demo --help')"], result.stderr


# --------------------------------------------------------------------------
# the demo, end to end
# --------------------------------------------------------------------------
def _run_cli_demo(tmp_path, *extra):
    output = tmp_path / "submission.csv"
    result = run_cli("demo", "--output", output, *extra, ok=False, timeout=900)
    assert result.returncode == 0, (result.stdout[-4000:], result.stderr[-4000:])
    return output, result.stdout


def _check_demo(output, stdout):
    # The plain calls really ran out of memory ...
    batch = demo.FIT_BATCH_SIZE
    assert re.search(rf"plain model\.fit\(batch_size={batch}\):\s+FAILED with "
                     r"ResourceExhaustedError: OOM when allocating tensor", stdout), stdout
    plain = re.search(r"plain model\.predict\(batch_size=28000\):\s+FAILED in [\d.]+ s with "
                      r"(ResourceExhaustedError: OOM when allocating tensor with shape\[[^\]]+\])",
                      stdout)
    assert plain, stdout
    # ... MemFit trained at that batch (one optimizer step per batch of 768),
    # and said how ...
    steps = -(-demo.DEFAULT_TRAIN_SAMPLES // batch)
    fitted = re.search(rf"model\.fit\(batch_size={batch}, callbacks=\[MemFit\(\)\]\):\s+OK, "
                       rf"{steps} optimizer steps in [\d.]+ s, (\d+) OOM\(s\) caught", stdout)
    assert fitted and int(fitted.group(1)) >= 1, stdout
    assert re.search(r"event: epoch 0 step 0 train oom: split 1 -> \d+", stdout), stdout
    # ... safe_predict recovered at a smaller batch size, and said how.
    assert re.search(r"keras_memfit\.safe_predict\(batch_size=28000\):\s+OK, 28000 labels", stdout)
    used = int(re.search(r"batch size used: (\d+)", stdout).group(1))
    assert 1 <= used < 28000
    assert re.search(r"adapted: predict on model 'digits_cnn'", stdout), stdout
    reported = float(re.search(r"accuracy against the generated test labels: ([\d.]+)",
                               stdout).group(1))
    # TensorFlow's allocator dump (on the worker's stderr) stays out of the report.
    assert "bfc_allocator" not in stdout and "BFCAllocator" not in stdout

    # submission.csv: Kaggle's format ...
    with open(output) as f:
        lines = f.read().splitlines()
    assert lines[0] == "ImageId,Label"
    assert len(lines) == 28001
    rows = np.array([[int(v) for v in line.split(",")] for line in lines[1:]])
    np.testing.assert_array_equal(rows[:, 0], np.arange(1, 28001))
    assert rows[:, 1].min() >= 0 and rows[:, 1].max() <= 9
    # ... with labels that agree with the generated ground truth, recomputed
    # here from the seed rather than taken from the demo's report ...
    *_, y_test = digits.load_digits(0, 28000, seed=0, return_test_labels=True)
    accuracy = float(np.mean(rows[:, 1] == y_test))
    assert accuracy >= 0.8
    assert abs(accuracy - reported) < 1e-4
    return rows[:, 1], used


def _plain_fit_labels(rows):
    """The labels of the first `rows` test digits by plain Keras's fit, without the cap."""
    import keras

    x_train, y_train, x_test = digits.load_digits(demo.DEFAULT_TRAIN_SAMPLES, 28000, seed=0)
    keras.utils.set_random_seed(0)
    model = demo.build_cnn()
    keras.utils.set_random_seed(0)
    model.fit((x_train[..., None] / 255.0).astype("float32"), y_train,
              batch_size=demo.FIT_BATCH_SIZE, epochs=demo.DEFAULT_EPOCHS, verbose=0)
    probs = model.predict((x_test[:rows, ..., None] / 255.0).astype("float32"), verbose=0)
    return probs.argmax(axis=-1)


@pytest.mark.tensorflow(
    reason="the application's worker runs Keras on TensorFlow (app/env.py), capped"
)
def test_demo_plain_calls_oom_and_memfit_and_safe_predict_write_the_submission(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:  # the reference trains while the demo waits on OOMs
        run = pool.submit(_run_cli_demo, tmp_path, "--device", "cpu")
        expected = _plain_fit_labels(2000)
        output, stdout = run.result()
    labels, used = _check_demo(output, stdout)
    # The CPU cap makes ~0.3 MiB per sample: a few hundred samples per batch.
    assert used < 2000
    assert "[1/5]" in stdout and "[5/5]" in stdout
    # MemFit trained the model plain Keras trains where memory is enough: its
    # labels are those of the uncapped plain fit (a model trained otherwise,
    # e.g. on another shuffle, disagrees on about one in 25).
    agree = float(np.mean(labels[:2000] == expected))
    assert agree >= 0.995, agree


@pytest.mark.gpu
def test_demo_on_gpu_with_a_logical_device_memory_limit(tmp_path):
    output, stdout = _run_cli_demo(tmp_path, "--device", "gpu", "--quiet")
    _check_demo(output, stdout)
    assert f"GPU, {demo.DEFAULT_GPU_MEMORY_LIMIT_MB} MiB" in stdout
