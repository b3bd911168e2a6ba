"""`keras-memfit report`, end to end in subprocesses.

A small model is saved to a temporary folder and `python -m keras_memfit
report` run on it. Its weights are hand-counted here (Dense 784 -> 10:
7,850 float32 parameters, 31,400 bytes), and the JSON it prints must be the
report `keras_memfit.memory_report` gives in this process with the same
arguments (the command line only loads, forwards and prints). Errors are one
line on stderr with a non-zero exit status; those caught before TensorFlow
starts are checked in-process.
"""

from __future__ import annotations

import json
import re

import pytest

from cli_support import assert_one_line_error, run_cli
from keras_memfit.app import cli
from support import requires_memory_report

pytestmark = pytest.mark.tensorflow(
    reason="the command line runs on TensorFlow whatever KERAS_BACKEND says (app/env.py); it runs in the TensorFlow legs"
)

DENSE_WEIGHT_BYTES = (784 * 10 + 10) * 4  # kernel + bias, float32


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    import keras

    folder = tmp_path_factory.mktemp("report")
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(4, 3, activation="relu", name="conv"),
            keras.layers.Flatten(name="flat"),
            keras.layers.Dense(10, activation="softmax", name="head"),
        ],
        name="tiny_cnn",
    )
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.save(folder / "cnn.keras")
    dense = keras.Sequential(
        [keras.Input((784,)), keras.layers.Dense(10, name="only")], name="dense"
    )
    dense.save(folder / "dense.keras")
    return folder


def _run(*args, ok=True):
    return run_cli("report", *args, ok=ok)


def _numbers(tree):
    """Every number in a JSON tree."""
    if isinstance(tree, dict):
        for value in tree.values():
            yield from _numbers(value)
    elif isinstance(tree, list):
        for value in tree:
            yield from _numbers(value)
    elif isinstance(tree, (int, float)) and not isinstance(tree, bool):
        yield tree


def test_table_names_every_layer_and_counts_the_saved_optimizer(saved):
    result = _run(saved / "cnn.keras", "--batch-size", 64)
    for layer in ("conv", "flat", "head"):
        assert re.search(rf"\b{layer}\b", result.stdout), result.stdout
    # head: Dense 2704 -> 10, 27,050 float32 weights = 105.7 KiB, and Adam's
    # two slots per weight (the model was saved compiled) = 211.3 KiB.
    head = next(line for line in result.stdout.splitlines() if line.startswith("head "))
    assert "27,050" in head and "105.7 KiB" in head and "211.3 KiB" in head, head
    assert "batch_size=64" in result.stdout


@requires_memory_report()
@pytest.mark.tensorflow(
    reason="compares the CLI worker's report (Keras on TensorFlow, app/env.py) with this process's"
)
def test_json_is_the_report_of_the_saved_model(saved):
    import keras

    from keras_memfit import memory_report

    result = _run(saved / "dense.keras", "--batch-size", 100, "--inference",
                  "--budget", 1, "--json")
    printed = json.loads(result.stdout)  # stdout holds the JSON and nothing else
    assert DENSE_WEIGHT_BYTES in set(_numbers(printed))
    model = keras.saving.load_model(saved / "dense.keras", compile=False)
    expected = memory_report(model, batch_size=100, training=False, budget=1 << 20)
    assert printed == json.loads(json.dumps(expected.to_dict(), default=cli._jsonable))


def test_model_that_will_not_load_is_one_line(tmp_path):
    import zipfile

    model = tmp_path / "not_a_model.keras"
    with zipfile.ZipFile(model, "w") as z:  # a zip, but not a Keras model
        z.writestr("hello.txt", "hi")
    result = _run(model, ok=False)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr and result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert re.match(r"keras-memfit: error: cannot load model not_a_model\.keras: ", lines[0])


@pytest.mark.parametrize(
    "argv, code, pattern",
    [
        (["missing.keras"], 1, r"cannot load model missing\.keras: no such file"),
        (["garbage.keras"], 1,
         r"cannot load model garbage\.keras: not a \.keras file \(not a zip archive\)"),
        (["folder.keras"], 1, r"cannot load model folder\.keras: it is a folder"),
        (["m.keras", "--batch-size", "0"], 2, r"--batch-size: expected an integer >= 1, got '0'"),
        (["m.keras", "--batch-size", "many"], 2,
         r"--batch-size: expected an integer >= 1, got 'many'"),
        (["m.keras", "--budget", "-5"], 2, r"--budget: expected an integer >= 1, got '-5'"),
        ([], 2, r"the following arguments are required: MODEL"),
    ],
)
def test_errors_caught_before_tensorflow_starts(tmp_path, monkeypatch, capsys, argv, code,
                                                pattern):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.keras").write_bytes(b"PK\x05\x06" + b"\0" * 18)  # an empty zip
    (tmp_path / "garbage.keras").write_text("garbage")
    (tmp_path / "folder.keras").mkdir()
    assert_one_line_error(capsys, ["report", *argv], code, pattern)


def test_help_lists_the_options(capsys):
    assert cli.main(["report", "--help"]) == 0
    out = capsys.readouterr().out
    for option in ("MODEL", "--batch-size", "--inference", "--budget", "--json"):
        assert option in out
