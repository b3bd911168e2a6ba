"""Every backend provides every member of the seam, from the module its concern names.

Checked on the source of every backend in `keras_memfit.backend.SUPPORTED`
with `ast`, so TensorFlow, JAX and torch are checked whichever of them is
installed: the package's `__init__` imports each member of `base.Backend`
from the concern's module, which defines it with the protocol's parameters,
or takes the seam's default from `base`; a capability may instead be None
(`placement`). The active backend is also
imported, and `backend.get()` must hold every member.
"""

from __future__ import annotations

import ast
import inspect
import os
from typing import Dict, List, Optional, Tuple

import pytest

from keras_memfit import backend
from keras_memfit.backend import base

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKEND_DIR = os.path.join(ROOT, "keras_memfit", "backend")
# The module of every backend package that provides each concern (as Keras's
# backends have the same module names in each).
CONCERNS = {
    base.OutOfMemory: "oom", base.Memory: "memory", base.Steps: "steps",
    base.Training: "training", base.KerasFunctions: "keras_functions", base.Devices: "devices",
    base.Tracing: "tracing", base.Distribution: "distribution",
}
CAPABILITIES = {"placement": base.Placement}


def _top_level(path: str) -> Dict[str, Optional[List[str]]]:
    """Name -> parameter names (None where not a `def`) of what a module defines or imports."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    names: Dict[str, Optional[List[str]]] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            names[node.name] = [  # in `inspect.signature`'s order
                a.arg for a in args.posonlyargs + args.args + [args.vararg] + args.kwonlyargs
                + [args.kwarg] if a is not None]
        elif isinstance(node, ast.ClassDef):
            names[node.name] = None
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Name):
                        names[leaf.id] = None
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names[alias.asname or alias.name.split(".")[0]] = None
    return names


def _bindings(path: str) -> Dict[str, str]:
    """Name -> where a package's `__init__` binds it: "module:<dotted>", "None" or "other"."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    found: Dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                found[alias.asname or alias.name] = f"module:{node.module}"
        elif isinstance(node, ast.Assign):
            value = "None" if (isinstance(node.value, ast.Constant)
                               and node.value.value is None) else "other"
            for target in node.targets:
                if isinstance(target, ast.Name):
                    found[target.id] = value
    return found


def members(protocol: type) -> Tuple[str, ...]:
    """The names a protocol and its protocol bases declare: attributes, then methods."""
    names: List[str] = []
    for cls in reversed(protocol.__mro__):
        if cls.__module__ != base.__name__:  # object, typing's Protocol and Generic
            continue
        own = vars(cls)
        names += own.get("__annotations__", {})
        names += [name for name, value in own.items()
                  if callable(value) and not name.startswith("_")]
    return tuple(dict.fromkeys(names))


def _parameters(protocol: type, member: str) -> Optional[List[str]]:
    """The parameter names of a protocol's method (without `self`); None for an attribute."""
    value = vars(protocol).get(member)
    if not callable(value):
        return None
    return list(inspect.signature(value).parameters)[1:]


def _missing(name: str, folder: str = BACKEND_DIR) -> List[str]:
    """What backend `name` (a package in `folder`) lacks of the seam, checked on its source."""
    package = os.path.join(folder, name)
    bound = _bindings(os.path.join(package, "__init__.py"))
    problems = []
    for protocol, concern in CONCERNS.items():
        path = os.path.join(package, f"{concern}.py")
        defined = _top_level(path) if os.path.isfile(path) else {}
        for member in members(protocol):
            where = bound.get(member)
            if member in CAPABILITIES:
                module = f"module:keras_memfit.backend.{name}"
                if where not in ("None", module):
                    problems.append(f"{name}: {member} is neither None nor a module of it")
                continue
            default = callable(getattr(base, member, None))
            if where == "module:keras_memfit.backend.base" and default:
                continue  # the seam's default
            if where != f"module:keras_memfit.backend.{name}.{concern}":
                problems.append(f"{name}/__init__.py does not import {member} from {concern}")
                continue
            if member not in defined:
                problems.append(f"{name}/{concern}.py lacks {protocol.__name__}.{member}")
                continue
            wanted, found = _parameters(protocol, member), defined[member]
            if wanted is not None and found is not None and found != wanted:
                problems.append(
                    f"{name}/{concern}.py: {member}({', '.join(found)}), "
                    f"the protocol's takes ({', '.join(wanted)})")
    return problems


def test_the_concerns_are_the_whole_seam():
    declared = {m for protocol in CONCERNS for m in members(protocol)}
    assert declared == set(members(base.Backend))


@pytest.mark.parametrize("name", backend.SUPPORTED)
def test_every_backend_provides_every_member_of_its_concerns(name):
    assert _missing(name) == []


@pytest.mark.parametrize("name", backend.SUPPORTED)
def test_a_capability_a_backend_has_provides_all_of_it(name):
    bound = _bindings(os.path.join(BACKEND_DIR, name, "__init__.py"))
    for capability, protocol in CAPABILITIES.items():
        if bound[capability] == "None":
            continue
        path = os.path.join(BACKEND_DIR, name, f"{capability}.py")
        defined = _top_level(path)
        assert [m for m in members(protocol) if m not in defined] == []


@pytest.mark.parametrize("name", backend.SUPPORTED)
def test_no_backend_keeps_an_export_list(name):
    folder = os.path.join(BACKEND_DIR, name)
    listing = sorted(
        file for file in os.listdir(folder)
        if file.endswith(".py") and "__all__" in _top_level(os.path.join(folder, file))
    )
    assert listing == []


def test_the_check_finds_a_missing_member_and_a_wrong_signature(tmp_path):
    fake = tmp_path / "fake"
    fake.mkdir()
    imports = ["placement = None"]
    for protocol, concern in CONCERNS.items():
        lines = []
        names = []
        for member in members(protocol):
            if member in CAPABILITIES:
                continue
            params = _parameters(protocol, member)
            if member == "reset_peak":
                params = ["name"]  # renamed
            if member != "is_oom_error":  # missing from its module
                lines.append(f"{member} = None" if params is None
                             else f"def {member}({', '.join(params)}): pass")
            if member != "checkpoint":  # not imported by the package
                names.append(member)
        (fake / f"{concern}.py").write_text("\n".join(lines) + "\n")
        imports.append(f"from keras_memfit.backend.fake.{concern} import {', '.join(names)}")
    (fake / "__init__.py").write_text("\n".join(imports) + "\n")
    assert _missing("fake", str(tmp_path)) == [
        "fake/oom.py lacks OutOfMemory.is_oom_error",
        "fake/memory.py: reset_peak(name), the protocol's takes (device)",
        "fake/__init__.py does not import checkpoint from training",
    ]


def test_the_active_backend_holds_every_member():
    active = backend.get()
    assert [m for m in members(base.Backend) if not hasattr(active, m)] == []
    placement = active.placement
    assert placement is None or [
        m for m in members(base.Placement) if not hasattr(placement, m)] == []
