"""The command line's parent process starts without TensorFlow.

The work that needs TensorFlow runs in the worker process, after its memory
limit is set. (The static layering rules, the library never importing the
applications and only `app/env.py` importing TensorFlow among them, are in
tests/test_architecture.py.)
"""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
