"""Runs the `Example:` doctests of the public front ends' docstrings."""

from __future__ import annotations

import doctest
import importlib

import keras
import numpy as np
import pytest

# The public modules whose docstrings hold examples (each must run at least one).
MODULES = [
    "keras_memfit.callbacks",
    "keras_memfit.evaluate",
    "keras_memfit.oom",
    "keras_memfit.predict",
    "keras_memfit.report",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(
        module,
        extraglobs={"keras": keras, "np": np},
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
        report=True,
    )
    assert result.attempted > 0, f"{name} has no examples left: take it out of MODULES"
    assert result.failed == 0
