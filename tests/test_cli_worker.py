"""The applications' worker runner and the one capped-allocator environment recipe.

`keras_memfit.app.env.capped_cpu_env` is what the command line, the
benchmarks and the tests' `memory_cap` marker put in a child's environment;
`keras_memfit.app.worker.run_worker` runs work in a child and turns every
failure into one line. The work here is plain Python (no TensorFlow), so each
child takes a fraction of a second.
"""

from __future__ import annotations

import os
import sys

import pytest

from keras_memfit.app import env, worker
from keras_memfit.app.errors import WorkerError

TESTS = os.path.dirname(os.path.abspath(__file__))


def test_capped_cpu_env_is_the_whole_recipe():
    assert env.capped_cpu_env(400) == {
        "TF_CPU_ALLOCATOR_USE_BFC": "true",
        "TF_CPU_BFC_MEM_LIMIT_IN_MB": "400",
        "TF_ENABLE_ONEDNN_OPTS": "0",
        "CUDA_VISIBLE_DEVICES": "-1",
    }
    assert env.capped_cpu_env(1) is not env.capped_cpu_env(1)  # a fresh dict each time
    for bad in (0, -5, 1.5, "400", None, True):
        with pytest.raises(ValueError, match=r"mb must be a positive int of MiB; received mb="):
            env.capped_cpu_env(bad)


def test_worker_environment_on_cpu_is_the_capped_recipe():
    base = {"PATH": "/bin"}
    cpu = env.worker_environment("cpu", 300, base)
    assert {k: cpu[k] for k in env.capped_cpu_env(300)} == env.capped_cpu_env(300)
    uncapped = env.worker_environment("cpu", None, dict(base, TF_CPU_BFC_MEM_LIMIT_IN_MB="9"))
    assert uncapped["TF_CPU_BFC_MEM_LIMIT_IN_MB"] == "9"  # left as the caller had it
    assert "TF_CPU_ALLOCATOR_USE_BFC" not in uncapped


def _run(target, config, **kwargs):
    lines = []
    kwargs.setdefault("env", env.worker_environment("cpu", None))
    result = worker.run_worker(
        target, config, report=lines.append, cwd=TESTS, what="the test worker", **kwargs
    )
    return result, lines


def test_run_worker_relays_lines_and_returns_the_result():
    result, lines = _run("cli_support:echo_work",
                         dict(lines=["one", "two"], result={"n": 2}, device="cpu"))
    assert result == {"n": 2}
    assert lines == ["one", "two"]


def test_run_worker_failure_is_one_line_and_keeps_the_traceback():
    with pytest.raises(WorkerError) as info:
        _run("cli_support:failing_work", dict(key="k"))
    assert str(info.value) == "KeyError: 'no such key: k'"
    assert "Traceback" in info.value.stderr and "failing_work" in info.value.stderr


def test_run_worker_bad_target_and_timeout_are_one_line():
    with pytest.raises(WorkerError, match=r"^ValueError: target must be 'module:function'"):
        _run("cli_support.echo_work", {})
    with pytest.raises(WorkerError, match=r"^the test worker timed out after 1 s$"):
        _run("cli_support:sleeping_work", dict(seconds=30), timeout=1)


def test_worker_module_usage_error():
    assert worker.main(["only-one"]) == 2
    assert worker.MODULE == "keras_memfit.app.worker" and sys.modules[worker.MODULE] is worker
