"""Helpers shared by the command-line tests (test_cli_*.py, test_demo.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np

from keras_memfit.app import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(command: str, *args, ok: bool = True, timeout: int = 300):
    """Runs `python -m keras_memfit COMMAND ARGS...` in a subprocess.

    With `ok`, checks that it exited 0 and wrote nothing on stderr.
    """
    result = subprocess.run(
        [sys.executable, "-m", "keras_memfit", command, *map(str, args)],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout,
    )
    if ok:
        assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
        assert result.stderr == ""
    return result


def assert_one_line_error(capsys, argv, code: int, pattern: str) -> str:
    """`cli.main(argv)` returns `code`, prints nothing on stdout and one
    `keras-memfit: error: ...` line matching `pattern` on stderr."""
    assert cli.main(argv) == code
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("keras-memfit: error: ")
    assert re.search(pattern, lines[0]), lines[0]
    return lines[0]


def to_kaggle_csv(path, images, labels=None) -> None:
    """Writes images [n, 28, 28] (and labels [n]) as Kaggle's Digit Recognizer
    `train.csv` (`label,pixel0,...,pixel783`), or without labels `test.csv`."""
    table = np.asarray(images).reshape(len(images), -1)
    header = [f"pixel{i}" for i in range(table.shape[1])]
    if labels is not None:
        table, header = np.column_stack([labels, table]), ["label"] + header
    np.savetxt(path, table, fmt="%d", delimiter=",", header=",".join(header), comments="")


# Work for `keras_memfit.app.worker.run_worker` tests (run with cwd=tests/).
def echo_work(config, say):
    """Says each of config["lines"], returns config["result"]."""
    for line in config.get("lines", []):
        say(line)
    return config.get("result", {})


def failing_work(config, say):
    """Raises a non-WorkerError, as a bug in the work would."""
    raise KeyError("no such key: " + config.get("key", "?"))


def sleeping_work(config, say):
    """Sleeps config["seconds"] (for the timeout)."""
    import time

    time.sleep(config["seconds"])
    return {}
