"""The applications sit on top of the library: imports point one way.

- No module of the library (`keras_memfit` outside `keras_memfit/app/`)
  imports `keras_memfit.app`, in code or in a docstring example.
- Within the applications, only the environment setup (`app/env.py`) imports
  TensorFlow; everything else reaches it through Keras, keras_memfit's public
  API or the backend seam (`keras_memfit.backend.get()`).
- The command line's parent process starts without TensorFlow (the work that
  needs it runs in the worker process, after its memory limit is set).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "keras_memfit")
APP = os.path.join(PACKAGE, "app")


def _python_files(folder):
    for parent, _, names in os.walk(folder):
        for name in sorted(names):
            if name.endswith(".py"):
                yield os.path.join(parent, name)


def _imported(path):
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            yield from (f"{node.module}.{a.name}" for a in node.names)


# Library docstrings that still import the demo by its old name, to be fixed in
# their owners' files (issue 10); empty this set once they are.
_PENDING_DOCSTRING_FIXES = {os.path.join("keras_memfit", "report.py")}


def test_the_library_never_imports_the_app():
    offenders = []
    for path in _python_files(PACKAGE):
        relative = os.path.relpath(path, ROOT)
        if path.startswith(APP + os.sep) or relative == os.path.join("keras_memfit", "__main__.py"):
            continue  # the applications, and `python -m keras_memfit`'s delegate to them
        with open(path, encoding="utf-8") as f:
            text = f.read()
        uses = [m for m in _imported(path) if m.startswith("keras_memfit.app")]
        # Docstrings too: `>>> from keras_memfit.demo import build_cnn` in the
        # library would make its examples depend on the applications.
        in_text = "keras_memfit.app" in text or (
            "keras_memfit.demo" in text and relative not in _PENDING_DOCSTRING_FIXES)
        if uses or in_text:
            offenders.append((relative, uses))
    assert offenders == []


def test_only_the_environment_setup_imports_tensorflow_in_the_app():
    importers = sorted(
        os.path.relpath(path, ROOT) for path in _python_files(APP)
        if any(m == "tensorflow" or m.startswith("tensorflow.") for m in _imported(path))
    )
    assert importers == [os.path.join("keras_memfit", "app", "env.py")]


def test_the_command_line_parent_starts_without_tensorflow():
    code = (
        "import sys\n"
        "from keras_memfit.app import cli, demo, env, inputs, models, outputs, worker\n"
        "import keras_memfit.__main__\n"
        "cli.build_parser().parse_args(['demo', '--quiet'])\n"
        "assert 'tensorflow' not in sys.modules and 'keras' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
