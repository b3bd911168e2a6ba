"""Every Python block of README.md and docs/*.md runs as written and prints what it shows.

Each block runs in a fresh Python process (tests/docs_blocks.py: its
directives, fixtures and output rule), as a reader's script runs it: under
TensorFlow's capped allocator where the Markdown asks for a memory cap, with
`KERAS_BACKEND=jax` where it asks for JAX; the blocks selected in a session
run side by side (the capped ones mostly wait: each OOM costs ~10 s). A block
the Markdown skips is reported skipped with the Markdown's reason.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import docs_blocks
from keras_memfit.app.env import capped_cpu_env

ROOT = docs_blocks.ROOT
BLOCKS = docs_blocks.blocks()
JAX = importlib.util.find_spec("jax") is not None
_ran = {}  # block id -> (exit status, what it printed after the fixtures)


def _params():
    for block in BLOCKS:
        if block.skip:
            marks = [pytest.mark.skip(reason=f"{block.id}: {block.skip}")]
        elif block.backend == "jax":
            marks = [pytest.mark.skipif(not JAX, reason=f"{block.id} runs on JAX, not installed")]
        else:
            marks = [pytest.mark.tensorflow(reason="the docs' blocks run on TensorFlow, "
                                                   "the default backend")]
        yield pytest.param(block, id=block.id, marks=marks)


def _run(block, folder):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TF_CPU_")}
    env.update(KERAS_BACKEND=block.backend, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]))
    if block.memory_cap:
        env.update(capped_cpu_env(block.memory_cap))
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, docs_blocks.__file__, block.path, str(block.line)],
        cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=600,
    )
    _, marker, printed = proc.stdout.partition(docs_blocks.MARKER)
    print(f"{block.id}: {time.perf_counter() - start:.1f} s")
    return proc.returncode, printed if marker else proc.stdout


@pytest.fixture
def ran(request, tmp_path_factory):
    """Runs every block this session selected (once, side by side); the results by id."""
    if not _ran:
        params = [getattr(getattr(item, "callspec", None), "params", {})
                  for item in request.session.items
                  if item.path == request.node.path and not item.get_closest_marker("skip")]
        selected = [p["block"] for p in params if "block" in p]
        selected = [b for b in selected if not b.skip and (b.backend != "jax" or JAX)]
        # The capped ones first: they wait longest (their OOMs), using little CPU.
        selected.sort(key=lambda b: -(b.memory_cap or 0))
        folders = [tmp_path_factory.mktemp("docs_block") for _ in selected]
        with ThreadPoolExecutor(6) as pool:
            _ran.update(zip([b.id for b in selected], pool.map(_run, selected, folders)))
    return _ran


@pytest.mark.parametrize("block", _params())
def test_block_runs_and_prints_what_it_shows(block, ran):
    code, printed = ran[block.id]
    assert code == 0, f"{block.id} failed (exit {code}):\n{printed[-6000:]}"
    missing = docs_blocks.missing_output(block.output, printed)
    assert missing is None, (
        f"{block.id} did not print what the docs show; missing:\n  {missing}\n"
        f"printed:\n{printed[-6000:]}"
    )


def test_every_python_block_is_found():
    """The parser misses no block: as many as the Markdown's ```python fences."""
    fences = 0
    for path in docs_blocks.markdown_files():
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            fences += sum(line.strip() == "```python" for line in f)
    assert len(BLOCKS) == fences > 0


def test_output_rule():
    printed = ("Layer  Params  Slots\ndense  1,290  5.0 KiB  10.1 KiB\n"
               "[{'kind': 'oom', 'rows': 2}]\n")
    assert docs_blocks.missing_output(["dense 1,290 10.1 KiB"], printed) is None
    assert docs_blocks.missing_output(["[{'kind': 'oom', ...}]"], printed) is None
    assert docs_blocks.missing_output(["dense 10.1 KiB 1,290"], printed) == "dense 10.1 KiB 1,290"
    # In order: a line found before the previous one's does not count.
    assert docs_blocks.missing_output(["dense", "Layer"], printed) == "Layer"
