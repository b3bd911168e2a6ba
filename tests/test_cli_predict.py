"""`keras-memfit predict`, end to end in subprocesses.

Tiny models are saved to a temporary folder, their inputs written as .npy,
.npz and Kaggle .csv files, and `python -m keras_memfit predict` run on them;
what it writes is compared with an independent reference computed here with
`model.predict(x, batch_size=7)`. Each run that reaches TensorFlow costs a
few seconds (the child process imports it); errors caught before TensorFlow
starts are checked in-process too.
"""

from __future__ import annotations

import os
import re

import keras
import numpy as np
import pytest

from cli_support import assert_one_line_error, run_cli, to_kaggle_csv
from keras_memfit.app import cli, digits

pytestmark = pytest.mark.tensorflow(
    reason="the command line predicts on TensorFlow whatever KERAS_BACKEND says (app/env.py); it runs in the TensorFlow legs"
)

N = 60  # not a multiple of the batch sizes used, so last batches are partial

# The command line runs its model on TensorFlow (app.env.worker_environment);
# the references come from the suite's backend: under KERAS_BACKEND=torch its
# CPU convolution differs from TensorFlow's by up to 2.5e-5 relative (measured).
CLI_RTOL = 1e-5 if keras.backend.backend() == "tensorflow" else 1e-4



@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Saved models, their inputs, and reference predictions."""
    import keras

    folder = tmp_path_factory.mktemp("predict")
    keras.utils.set_random_seed(0)
    cnn = keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(4, 3, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(
                10, activation="softmax",
                kernel_initializer=keras.initializers.RandomNormal(stddev=0.3),
            ),
        ],
        name="tiny_cnn",
    )
    cnn.save(folder / "cnn.keras")
    meta = keras.Input((5,), name="meta")
    image = keras.Input((28, 28, 1), name="image")
    hidden = keras.layers.Dense(8, activation="relu")(keras.layers.Flatten()(image))
    joint = keras.layers.Concatenate()([hidden, meta])
    two = keras.Model([meta, image], keras.layers.Dense(3, activation="softmax")(joint),
                      name="two_inputs")
    two.save(folder / "two.keras")

    images, labels = digits.generate_digits(N, seed=1)
    x = (images[..., None].astype("float32") / np.float32(255))
    to_kaggle_csv(folder / "train.csv", images, labels)
    to_kaggle_csv(folder / "test.csv", images)
    np.save(folder / "pixels.npy", images)  # uint8 [N, 28, 28]: needs --scale 255
    np.savez(folder / "flat.npz", whatever=x.reshape(N, 784))  # one array, any name
    m = np.random.default_rng(2).normal(size=(N, 5)).astype("float32")
    np.savez(folder / "two.npz", image=x, meta=m, label=labels)  # by name; extras ignored
    return dict(
        folder=folder,
        cnn=cnn.predict(x, batch_size=7, verbose=0),
        two=two.predict([m, x], batch_size=7, verbose=0),
    )


def _run(*args, ok=True):
    return run_cli("predict", *args, ok=ok)


def _read_csv(path):
    with open(path) as f:
        header = f.readline().strip().split(",")
    return header, np.loadtxt(path, delimiter=",", skiprows=1, ndmin=2)


def _assert_labels(labels, probs):
    """`labels` are argmax(probs), wherever the top two are not within rounding."""
    top2 = np.sort(probs, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 1e-4
    assert clear.mean() > 0.9
    np.testing.assert_array_equal(labels[clear], probs.argmax(-1)[clear])


def _no_leftovers(folder):
    assert not [name for name in os.listdir(folder) if ".partial" in name]


# --------------------------------------------------------------------------
# outputs
# --------------------------------------------------------------------------
def test_csv_with_argmax_writes_kaggles_submission(files):
    folder = files["folder"]
    out = folder / "submission.csv"
    result = _run(folder / "cnn.keras", folder / "test.csv", "--out", out,
                  "--argmax", "--batch-size", 7, "--quiet")
    assert result.stdout == ""
    header, rows = _read_csv(out)
    assert header == ["ImageId", "Label"]
    np.testing.assert_array_equal(rows[:, 0], np.arange(1, N + 1))
    _assert_labels(rows[:, 1].astype(int), files["cnn"])
    _no_leftovers(folder)


def test_train_csv_with_labels_to_a_probability_csv(files):
    folder = files["folder"]
    out = folder / "probs.csv"
    result = _run(folder / "cnn.keras", folder / "train.csv", "-o", out, "--batch-size", 256)
    # Uncapped: Keras's one batch of N rows, no probes (issue 49).
    assert re.search(rf"batch size: 256 asked, nothing adapted \(batches run: {N}\); 0 OOMs",
                     result.stdout), result.stdout
    header, rows = _read_csv(out)
    assert header == ["ImageId"] + [f"p{i}" for i in range(10)]
    np.testing.assert_array_equal(rows[:, 0], np.arange(1, N + 1))
    np.testing.assert_allclose(rows[:, 1:], files["cnn"], rtol=CLI_RTOL)


def test_npy_scaled_to_npy_and_the_summary(files):
    folder = files["folder"]
    out = folder / "probs.npy"
    result = _run(folder / "cnn.keras", folder / "pixels.npy", "--out", out,
                  "--scale", "255", "--batch-size", 16)
    written = np.load(out)
    assert written.shape == (N, 10) and written.dtype == np.float32
    np.testing.assert_allclose(written, files["cnn"], rtol=CLI_RTOL)
    lines = result.stdout.splitlines()
    assert len(lines) == 3, result.stdout
    assert re.match(rf"keras-memfit predict: {N} samples of pixels\.npy \(scaled by 1/255\) "
                    r"through model 'tiny_cnn' on CPU", lines[0]), lines[0]
    assert re.search(r"batch size: 16 asked, nothing adapted \(batches run: 16 x 3, 12\); "
                     r"0 OOMs paid", lines[1]), lines[1]
    assert re.search(rf"wrote .*probs\.npy \(outputs float32 \({N}, 10\)\) in [\d.]+ s",
                     lines[2]), lines[2]


def test_single_array_npz_of_flat_rows_is_reshaped_not_scaled(files):
    folder = files["folder"]
    out = folder / "flat_out.npy"
    _run(folder / "cnn.keras", folder / "flat.npz", "--out", out, "--quiet")
    np.testing.assert_allclose(np.load(out), files["cnn"], rtol=CLI_RTOL)


def test_multi_input_npz_maps_arrays_by_input_name(files):
    folder = files["folder"]
    out = folder / "two_labels.npy"
    # 59 + 1: a last batch of one label (Keras's logs turn it into a float).
    _run(folder / "two.keras", folder / "two.npz", "--out", out, "--argmax",
         "--batch-size", 59, "--quiet")
    labels = np.load(out)
    assert labels.shape == (N,) and np.issubdtype(labels.dtype, np.integer)
    _assert_labels(labels, files["two"])


@pytest.mark.tensorflow(
    reason="the application's worker runs Keras on TensorFlow (app/env.py), capped"
)
def test_memory_limit_adapts_a_batch_that_does_not_fit(files, tmp_path):
    import keras

    # 26 x 26 x 64 float32 activations: ~0.25 MiB per sample, so a batch of
    # 3000 (~750 MiB) cannot fit under a 300 MiB cap; the planner sizes the
    # batch from two small probes instead of paying the OOM.
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(64, 3, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(10, activation="softmax"),
        ],
        name="wide_cnn",
    )
    model.save(tmp_path / "wide.keras")
    x = np.random.default_rng(0).random((3000, 28, 28, 1), dtype=np.float32)
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "labels.csv"
    result = _run(tmp_path / "wide.keras", tmp_path / "x.npy", "--out", out, "--argmax",
                  "--batch-size", 3000, "--memory-limit", 300)
    assert "CPU, memory limited to 300 MiB" in result.stdout, result.stdout
    used = int(re.search(r"3000 asked, (\d+) used", result.stdout).group(1))
    assert 1 <= used < 3000
    header, rows = _read_csv(out)
    assert header == ["ImageId", "Label"] and len(rows) == 3000
    _assert_labels(rows[:, 1].astype(int), model.predict(x, batch_size=64, verbose=0))


# --------------------------------------------------------------------------
# errors: one line on stderr, a non-zero exit, no traceback
# --------------------------------------------------------------------------
def _check_error(result, pattern):
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("keras-memfit: error: ")
    assert re.search(pattern, lines[0]), lines[0]


@pytest.mark.parametrize(
    "case, pattern",
    [
        ("model_is_not_a_model", r"cannot load model not_a_model\.keras: "),
        ("shape", r"wrong_shape\.npy has samples of shape \(27, 28\), but the model's input "
                  r"'\w+' takes samples of shape \(28, 28, 1\)"),
        ("names", r"two_bad\.npz holds arrays \['image', 'other'\], but model 'two_inputs' "
                  r"takes inputs named \['meta', 'image'\] \(no array for \['meta'\]\)"),
        ("columns", r"columns\.csv is not a Kaggle Digit Recognizer CSV \(780 pixel columns "
                    r"missing\)"),
        ("argmax_2d", r"--argmax gives labels of shape \(3,\) per sample"),
    ],
)
def test_bad_inputs_fail_with_one_line(files, tmp_path, case, pattern):
    import zipfile

    folder = files["folder"]
    model, data, out = folder / "cnn.keras", None, tmp_path / "out.csv"
    if case == "model_is_not_a_model":
        model = tmp_path / "not_a_model.keras"
        with zipfile.ZipFile(model, "w") as z:  # a zip, but not a Keras model
            z.writestr("hello.txt", "hi")
        data = folder / "pixels.npy"
    elif case == "shape":
        data = tmp_path / "wrong_shape.npy"
        np.save(data, np.zeros((4, 27, 28), np.uint8))
    elif case == "names":
        model, data = folder / "two.keras", tmp_path / "two_bad.npz"
        np.savez(data, image=np.zeros((4, 28, 28, 1)), other=np.zeros((4, 5)))
    elif case == "columns":
        data = tmp_path / "columns.csv"
        data.write_text("label,pixel0,pixel1,pixel2,pixel3\n1,0,0,0,0\n")
    else:  # labels of shape (3,) per sample cannot be one CSV column
        import keras

        model = tmp_path / "seq.keras"
        keras.Sequential([keras.Input((3, 4)), keras.layers.Dense(2)]).save(model)
        data = tmp_path / "seq.npy"
        np.save(data, np.zeros((4, 3, 4), np.float32))
        out = tmp_path / "labels.csv"
    result = _run(model, data, "--out", out, "--argmax", ok=False)
    _check_error(result, pattern)
    assert not out.exists()
    _no_leftovers(tmp_path)


@pytest.mark.parametrize(
    "argv, code, pattern",
    [
        (["m.keras", "x.txt", "--out", "o.npy"], 2,
         r"INPUT must be a \.npy, \.npz or \.csv file; received 'x\.txt'"),
        (["m.keras", "x.npy", "--out", "o.json"], 2, r"--out must be a \.npy or \.csv file"),
        (["m.keras", "x.npy"], 2, r"the following arguments are required: --out"),
        (["m.keras", "x.npy", "--out", "o.npy", "--scale", "0"], 2,
         r"--scale: expected a positive number or 'none', got '0'"),
        (["m.keras", "x.npy", "--out", "o.npy", "--batch-size", "0"], 2,
         r"--batch-size: expected an integer >= 1"),
        (["missing.keras", "x.npy", "--out", "o.npy"], 1,
         r"cannot load model missing\.keras: no such file"),
        (["garbage.keras", "x.npy", "--out", "o.npy"], 1,
         r"cannot load model garbage\.keras: not a \.keras file \(not a zip archive\)"),
        (["m.keras", "missing.npy", "--out", "o.npy"], 1, r"cannot read missing\.npy: no such file"),
        (["m.keras", "garbage.npy", "--out", "o.npy"], 1,
         r"cannot read garbage\.npy as \.npy: not a \.npy file"),
        (["m.keras", "garbage.npz", "--out", "o.npy"], 1,
         r"cannot read garbage\.npz as \.npz: not a zip archive"),
        (["m.keras", "empty.npy", "--out", "o.npy"], 1, r"empty\.npy holds no samples"),
        (["m.keras", "x.npy", "--out", "x.npy"], 2, r"--out .*x\.npy would overwrite an input"),
        (["m.keras", "x.npy", "--out", "no/such/o.npy"], 1, r"folder .*no/such does not exist"),
    ],
)
def test_errors_caught_before_tensorflow_starts(tmp_path, monkeypatch, capsys, argv, code,
                                                pattern):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.keras").write_bytes(b"PK\x05\x06" + b"\0" * 18)  # an empty zip
    (tmp_path / "garbage.keras").write_text("garbage")
    np.save(tmp_path / "x.npy", np.zeros((3, 28, 28), np.uint8))
    np.save(tmp_path / "empty.npy", np.zeros((0, 28, 28), np.uint8))
    (tmp_path / "garbage.npy").write_text("garbage")
    (tmp_path / "garbage.npz").write_text("garbage")
    assert_one_line_error(capsys, ["predict", *argv], code, pattern)
    assert not (tmp_path / "o.npy").exists()


def test_help_lists_the_options(capsys):
    assert cli.main(["predict", "--help"]) == 0
    out = capsys.readouterr().out
    for option in ("MODEL", "INPUT", "--out", "--argmax", "--batch-size", "--scale",
                   "--memory-limit", "--quiet"):
        assert option in out
