"""Every backend provides every member of the seam's protocols, in the module its concern names.

`keras_memfit.backend.base.CONCERNS` pairs each concern's protocol with the
module that provides it in every backend package; a backend package keeps
no export list (`keras_memfit.backend.assemble` reads the members from those
modules). Checked here on the source of every backend in
`keras_memfit.backend.SUPPORTED` with `ast`, so TensorFlow, JAX and torch are
checked whichever of them is installed (nothing of theirs is imported): each
concern's module defines (or imports) each member of its protocol, a
function with the protocol's parameters. The active backend is also
imported, and `backend.get()` must hold every member.
"""

from __future__ import annotations

import ast
import inspect
import os
from typing import Dict, List, Optional

import pytest

from keras_memfit import backend
from keras_memfit.backend import base

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKEND_DIR = os.path.join(ROOT, "keras_memfit", "backend")


def _top_level(path: str) -> Dict[str, Optional[List[str]]]:
    """Name -> parameter names (None where not a `def`) of what a module defines or imports."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    names: Dict[str, Optional[List[str]]] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            names[node.name] = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
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


def _parameters(protocol: type, member: str) -> Optional[List[str]]:
    """The parameter names of a protocol's method (without `self`); None for an attribute."""
    value = vars(protocol).get(member)
    if not callable(value):
        return None
    return list(inspect.signature(value).parameters)[1:]


def _missing(name: str, folder: str = BACKEND_DIR) -> List[str]:
    """What backend `name` (a package in `folder`) lacks of the seam, checked on its source."""
    problems = []
    for concern, protocol in base.CONCERNS:
        path = os.path.join(folder, name, f"{concern}.py")
        if not os.path.isfile(path):
            problems.append(f"{name}: no module {concern}.py for {protocol.__name__}")
            continue
        defined = _top_level(path)
        for member in base.members(protocol):
            if member not in defined:
                problems.append(f"{name}/{concern}.py lacks {protocol.__name__}.{member}")
                continue
            wanted, found = _parameters(protocol, member), defined[member]
            if wanted is not None and found is not None and found != wanted:
                problems.append(
                    f"{name}/{concern}.py: {member}({', '.join(found)}), "
                    f"the protocol's takes ({', '.join(wanted)})")
    return problems


@pytest.mark.parametrize("name", backend.SUPPORTED)
def test_every_backend_provides_every_member_of_its_concerns(name):
    assert _missing(name) == []


@pytest.mark.parametrize("name", backend.SUPPORTED)
def test_no_backend_keeps_an_export_list(name):
    folder = os.path.join(BACKEND_DIR, name)
    listing = sorted(
        file for file in os.listdir(folder)
        if file.endswith(".py") and "__all__" in _top_level(os.path.join(folder, file))
    )
    assert listing == []


def test_the_check_finds_a_missing_member_and_a_wrong_signature(tmp_path):
    for concern, protocol in base.CONCERNS:
        lines = []
        for member in base.members(protocol):
            params = _parameters(protocol, member)
            if member == "is_oom_error":
                continue  # missing
            if member == "reset_peak":
                params = ["name"]  # renamed
            lines.append(f"{member} = None" if params is None
                         else f"def {member}({', '.join(params)}): pass")
        (tmp_path / "fake").mkdir(exist_ok=True)
        (tmp_path / "fake" / f"{concern}.py").write_text("\n".join(lines) + "\n")
    assert _missing("fake", str(tmp_path)) == [
        "fake/oom.py lacks OutOfMemory.is_oom_error",
        "fake/memory.py: reset_peak(name), the protocol's takes (device)",
    ]


def test_the_active_backend_holds_every_member():
    active = backend.get()
    missing = [
        f"{protocol.__name__}.{member}"
        for _, protocol in base.CONCERNS for member in base.members(protocol)
        if not hasattr(active, member)
    ]
    assert missing == []
