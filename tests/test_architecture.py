"""The layering ARCHITECTURE.md describes, checked on the source itself.

Every `import` in the package and the benchmarks (at module level or inside a
function) is read with `ast`; nothing is imported. The rules:

- no import cycle among keras_memfit's modules, nor among the benchmarks';
- the library never imports the applications (`keras_memfit.app`), the
  benchmarks or the tests;
- nothing outside `keras_memfit/backend/` imports TensorFlow, except the
  applications' environment set-up (`keras_memfit/app/env.py`), which must
  configure TensorFlow before it starts;
- Keras's private modules (`keras.src`) are reached only through
  `keras_memfit/_internal/keras_compat.py` and the backend packages;
- the layers (`LAYERS`, ARCHITECTURE.md) import only downwards: a module
  imports modules of its own layer or of the layers below it, so no
  algorithm and no backend module imports a public front end;
- the package root holds at most 10 modules;
- no backend function is a stub (a body that does nothing, or only raises
  `NotImplementedError`): a backend with nothing to do takes the seam's
  default from `backend/base.py`, and a capability it lacks is None;
- every module has its place on purpose, by concept: a module at the package
  root is named in `LAYERS`; a module (or subpackage) of a package is listed
  in its package's `__init__.py` docstring, once, as a bullet
  "- `name`: its concept", and every name listed there exists. A new module
  means a new bullet saying what one concept it holds; a concept that grows
  a second one gets a second module and a second bullet.
"""

from __future__ import annotations

import ast
import os
import re
from typing import Dict, List, Set

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "keras_memfit"
TENSORFLOW_ALLOWED = ("keras_memfit/backend/", "keras_memfit/app/env.py")
KERAS_SRC_ALLOWED = ("keras_memfit/backend/", "keras_memfit/_internal/keras_compat.py")
MAX_ROOT_MODULES = 10
# keras_memfit's layers, lowest first: each module belongs to the first layer
# whose prefix it has (module names relative to keras_memfit).
LAYERS = (
    ("internal", ("_internal",)),
    ("backend", ("backend",)),
    ("oom", ("oom",)),
    ("analysis", ("analysis",)),
    ("planning", ("planning",)),
    ("inference", ("inference",)),
    ("training", ("training",)),
    ("front ends", ("callbacks", "predict", "evaluate", "generate", "report", "placement", "")),
    ("applications", ("app", "__main__")),
)


def _modules(top: str) -> Dict[str, str]:
    """Module name -> path of every .py file under `top` (a folder of ROOT)."""
    found = {}
    for folder, _, files in os.walk(os.path.join(ROOT, top)):
        for file in files:
            if not file.endswith(".py"):
                continue
            path = os.path.join(folder, file)
            rel = os.path.relpath(path, ROOT)[: -len(".py")].split(os.sep)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            found[".".join(rel)] = path
    return found


def _tree(path: str) -> ast.Module:
    """The syntax tree of the source file `path`."""
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), filename=path)


def _imports(name: str, path: str, known: Set[str]) -> Set[str]:
    """Every module `path` imports (absolute names; `from a import b` is a.b if b is a module)."""
    tree = _tree(path)
    is_package = path.endswith("__init__.py")
    package = name if is_package else name.rpartition(".")[0]
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                names.add(candidate if candidate in known else base)
    return names


def _graph(top: str) -> Dict[str, Set[str]]:
    modules = _modules(top)
    known = set(modules)
    return {
        name: {m for m in _imports(name, path, known) if m in known and m != name}
        for name, path in modules.items()
    }


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _all_imports(top: str) -> Dict[str, Set[str]]:
    modules = _modules(top)
    return {
        os.path.relpath(path, ROOT).replace(os.sep, "/"): _imports(name, path, set(modules))
        for name, path in modules.items()
    }


@pytest.mark.parametrize("top", [PACKAGE, "benchmarks"])
def test_no_import_cycles(top):
    assert _cycles(_graph(top)) == []


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _is_application(path: str) -> bool:
    # `python -m keras_memfit` is the applications' entry point.
    return path.startswith("keras_memfit/app/") or path == "keras_memfit/__main__.py"


def test_library_does_not_import_applications_benchmarks_or_tests():
    offenders = {
        path: sorted(m for m in imported if m.startswith(("keras_memfit.app", "benchmarks", "tests")))
        for path, imported in _all_imports(PACKAGE).items()
        if not _is_application(path)
    }
    assert {p: m for p, m in offenders.items() if m} == {}


def test_library_docstrings_do_not_use_the_applications():
    # `>>> from keras_memfit.app.demo import build_cnn` in a library docstring
    # would make its examples depend on the applications.
    offenders = []
    for name, path in _modules(PACKAGE).items():
        rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if not _is_application(rel) and ("keras_memfit.app" in text or "keras_memfit.demo" in text):
            offenders.append(rel)
    assert offenders == []


def test_only_the_environment_set_up_imports_tensorflow_in_the_applications():
    importers = sorted(
        path for path, imported in _all_imports(PACKAGE).items()
        if _is_application(path)
        and any(m == "tensorflow" or m.startswith("tensorflow.") for m in imported)
    )
    assert importers == ["keras_memfit/app/env.py"]


def test_only_the_backend_imports_tensorflow():
    offenders = sorted(
        path for path, imported in _all_imports(PACKAGE).items()
        if any(m == "tensorflow" or m.startswith("tensorflow.") for m in imported)
        and not path.startswith(TENSORFLOW_ALLOWED)
    )
    assert offenders == []


def test_keras_private_api_is_quarantined():
    offenders = sorted(
        path for path, imported in _all_imports(PACKAGE).items()
        if any(m.startswith("keras.src") for m in imported)
        and not path.startswith(KERAS_SRC_ALLOWED)
    )
    assert offenders == []


_BULLET = re.compile(r"^- `(\w+)`: \S", re.MULTILINE)


def _unplaced(package: str, root: str = ROOT) -> List[str]:
    """What a package's docstring and its folder disagree on (`package`: a folder of `root`).

    Its modules and subpackages must each be listed once in its `__init__.py`
    docstring as "- `name`: concept", and every listed name must exist.
    """
    folder = os.path.join(root, package)
    with open(os.path.join(folder, "__init__.py"), encoding="utf-8") as f:
        listed = _BULLET.findall(ast.get_docstring(ast.parse(f.read())) or "")
    present = {
        name[: -len(".py")] if name.endswith(".py") else name
        for name in os.listdir(folder)
        if (name.endswith(".py") and name != "__init__.py")
        or os.path.isfile(os.path.join(folder, name, "__init__.py"))
    }
    init = f"{package}/__init__.py"
    return sorted(
        [f"{package}/{m} is not listed in {init}: add \"- `{m}`: its concept\""
         for m in present - set(listed)]
        + [f"{init} lists `{m}`, which does not exist" for m in set(listed) - present]
        + [f"{init} lists `{m}` {listed.count(m)} times"
           for m in set(listed) if listed.count(m) > 1]
    )


def _packages() -> List[str]:
    """Every package under keras_memfit's root (whose own modules `LAYERS` names)."""
    return sorted(
        os.path.relpath(folder, ROOT).replace(os.sep, "/")
        for folder, _, files in os.walk(os.path.join(ROOT, PACKAGE))
        if "__init__.py" in files and folder != os.path.join(ROOT, PACKAGE)
    )


@pytest.mark.parametrize("package", _packages())
def test_every_module_is_listed_with_its_concept(package):
    assert _unplaced(package) == []


def test_concept_check_finds_unlisted_missing_and_twice_listed_modules(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text(
        '"""A package.\n\n- `a`: one concept;\n- `gone`: a removed one;\n'
        '- `a`: again.\n"""\n'
    )
    for name in ("a.py", "b.py"):
        (package / name).write_text("")
    assert _unplaced("pkg", str(tmp_path)) == [
        'pkg/__init__.py lists `a` 2 times',
        'pkg/__init__.py lists `gone`, which does not exist',
        'pkg/b is not listed in pkg/__init__.py: add "- `b`: its concept"',
    ]


def _layer(module: str) -> int:
    """The index in LAYERS of a keras_memfit module (`keras_memfit.x.y`)."""
    rel = module[len(PACKAGE) + 1:] if module != PACKAGE else ""
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if rel == prefix or (prefix and rel.startswith(prefix + ".")):
                return i
    raise AssertionError(f"{module} is in no layer of LAYERS: add it")


def _upward_imports(graph: Dict[str, Set[str]]) -> List[str]:
    return sorted(
        f"{m} ({LAYERS[_layer(m)][0]}) imports {d} ({LAYERS[_layer(d)][0]})"
        for m, deps in graph.items() for d in deps if _layer(d) > _layer(m)
    )


def test_every_module_is_in_a_layer():
    for module in _modules(PACKAGE):
        _layer(module)


def test_layers_import_only_downwards():
    assert _upward_imports(_graph(PACKAGE)) == []


def test_layer_check_finds_an_upward_import():
    graph = {
        "keras_memfit.planning.runner": {"keras_memfit.predict"},
        "keras_memfit.predict": {"keras_memfit.planning.runner"},
    }
    assert _upward_imports(graph) == [
        "keras_memfit.planning.runner (planning) imports keras_memfit.predict (front ends)"
    ]


def test_package_root_holds_at_most_ten_modules():
    root = sorted(
        f for f in os.listdir(os.path.join(ROOT, PACKAGE))
        if f.endswith(".py") and f != "__init__.py"
    )
    assert len(root) <= MAX_ROOT_MODULES, root


def _private_reads(paths: List[str]) -> List[str]:
    """Reads of another object's private member that a keras_memfit class defines.

    A class's private members are the `_name` attributes it assigns on `self`
    and its `_name` methods; reading one on anything but `self` or `cls`
    reaches into another object. (Keras's own private attributes, read
    through `_internal/keras_compat.py` and the backends, are not defined by
    keras_memfit's classes and so not counted.)
    """
    trees = {path: _tree(path) for path in paths}
    private: Set[str] = set()
    for tree in trees.values():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for node in ast.walk(cls):
                if isinstance(node, ast.FunctionDef):
                    name = node.name
                elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                      and isinstance(node.value, ast.Name) and node.value.id == "self"):
                    name = node.attr
                else:
                    continue
                if name.startswith("_") and not name.startswith("__"):
                    private.add(name)
    found = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr in private
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return sorted(found)


def test_nothing_reads_another_objects_private_members():
    assert _private_reads(list(_modules(PACKAGE).values())) == []


def test_private_read_check_finds_one(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "class Run:\n    def __init__(self):\n        self._planner = None\n"
        "class Other:\n    def train(self, run):\n        return run._planner\n"
    )
    assert [line.split(": ", 1)[1] for line in _private_reads([str(source)])] == ["run._planner"]


def _stubs(paths: List[str]) -> List[str]:
    """Top-level functions whose body does nothing or only raises `NotImplementedError`."""
    found = []
    for path in paths:
        for node in _tree(path).body:
            if not isinstance(node, ast.FunctionDef):
                continue
            body = [b for b in node.body
                    if not (isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant))]
            text = " ".join(ast.unparse(b) for b in body)
            if (not body or text in ("pass", "return", "return None")
                    or text.endswith("nullcontext()") and len(body) == 1
                    or text.startswith("raise NotImplementedError") and len(body) == 1):
                found.append(f"{os.path.relpath(path, ROOT)}: {node.name}")
    return sorted(found)


def test_no_backend_function_is_a_stub():
    backends = [path for name, path in _modules(PACKAGE).items()
                if name.startswith(f"{PACKAGE}.backend.") and name.count(".") >= 3]
    assert len(backends) > 20
    assert _stubs(backends) == []


def test_stub_check_finds_one(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "import contextlib\n"
        "def materialize(model):\n    \"\"\"Nothing.\"\"\"\n"
        "def evaluation(model):\n    return contextlib.nullcontext()\n"
        "def place(model):\n    raise NotImplementedError('no')\n"
        "def piece_multiple():\n    return 1\n"
    )
    assert [line.split(": ")[1] for line in _stubs([str(source)])] == [
        "evaluation", "materialize", "place"]


_STRATEGY_WORDS = re.compile(r"strateg|^Replicas$|^Replicated$|^Slots$|^Lanes$|distribute_values")


def _strategy_names(paths: List[str]) -> List[str]:
    """Names in code (not strings) that reach a `tf.distribute` strategy or its replica layout."""
    found = []
    for path in paths:
        for node in ast.walk(_tree(path)):
            names = []
            if isinstance(node, ast.Name):
                names = [node.id]
            elif isinstance(node, ast.Attribute):
                names = [node.attr]
            elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, ast.arg):
                names = [node.arg]
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [alias.asname or alias.name for alias in node.names]
            found += [f"{os.path.relpath(path, ROOT)}:{node.lineno}: {name}"
                      for name in names if _STRATEGY_WORDS.search(name)]
    return sorted(found)


def test_no_strategy_or_replica_layout_above_the_seam():
    above = [path for name, path in _modules(PACKAGE).items()
             if not name.startswith((f"{PACKAGE}.backend", f"{PACKAGE}.app"))]
    assert len(above) > 40
    assert _strategy_names(above) == []


def test_strategy_check_finds_one(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "def prepare(layout, model):\n"
        "    with layout.replicas.strategy.scope():\n"
        "        return 'a strategy in a string is fine'\n"
    )
    assert [line.split(": ")[1] for line in _strategy_names([str(source)])] == ["strategy"]


# Values cached per model that are not compiled steps: their keys need no variant.
_NOT_STEPS = {"couples_rows"}  # whether a model couples the rows of a batch


def _keys_without_variant(paths: List[str]) -> List[str]:
    """`per_model` calls whose key (a tuple, or a name bound to one in the same function)
    holds no `step_variant(...)` call: a step cached for one variant served to another."""
    found = []
    for path in paths:
        for function in ast.walk(_tree(path)):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            bound = {
                target.id: node.value
                for node in ast.walk(function) if isinstance(node, ast.Assign)
                for target in node.targets if isinstance(target, ast.Name)
            }
            for call in ast.walk(function):
                if not (isinstance(call, ast.Call) and len(call.args) >= 2
                        and getattr(call.func, "id", getattr(call.func, "attr", None))
                        == "per_model"):
                    continue
                key = call.args[1]
                if isinstance(key, ast.Name):
                    key = bound.get(key.id, key)
                if isinstance(key, ast.Constant) and key.value in _NOT_STEPS:
                    continue
                if not any(isinstance(node, ast.Call)
                           and getattr(node.func, "id", getattr(node.func, "attr", None))
                           == "step_variant" for node in ast.walk(key)):
                    found.append(f"{os.path.relpath(path, ROOT)}:{call.lineno}")
    return sorted(set(found))


def test_every_step_cache_key_holds_the_variant():
    paths = list(_modules(PACKAGE).values())
    caching = [path for path in paths if "per_model(" in ast.unparse(_tree(path))]
    assert len(caching) >= 5  # the check sees the modules that cache steps
    assert _keys_without_variant(paths) == []


def test_variant_check_finds_a_key_without_one(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "def step(model, backend):\n"
        "    key = ('predict', model.jit_compile)\n"
        "    return _cache.per_model(model, key, lambda: backend.make_step(model))\n"
        "\n"
        "def other(model, backend):\n"
        "    key = ('predict', backend.step_variant(model))\n"
        "    return per_model(model, key, lambda: backend.make_step(model))\n"
    )
    assert _keys_without_variant([str(source)]) == [f"{os.path.relpath(source, ROOT)}:3"]
