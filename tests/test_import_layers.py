"""The package's import graph: no cycles, and the floors of ARCHITECTURE.md section 6.

Every module under ``megatron_lrmoe/`` is parsed with ``ast`` (nothing is imported), and every
``import`` / ``from ... import`` of the package's own modules becomes an edge, wherever it stands:
at module level, under ``if TYPE_CHECKING:``, or inside a function (an import deferred to call
time still ties the two modules together). ``from pkg import name`` points at the submodule
``pkg.name`` when there is one, else at ``pkg`` (its ``__init__``). Importing a submodule is not
counted as importing its parent packages' ``__init__`` (Python runs those too, but every module
would then depend on the top-level ``__init__``).

Data flows down the table of section 6 (control -> dispatch -> experts -> select); the floors
checked here are the rules that table states outright:

* ``control/`` imports nothing of ``dispatch/``, ``select/``, ``experts/``, ``op.py``,
  ``layer.py`` (it plans with integers only);
* ``select/`` does not communicate: no ``torch.distributed`` and no ``dispatch/comm.py``;
* ``control/reference.py`` (the slow references the tests compare with) is imported by no
  module of the package;
* the stage folders (``control/``, ``dispatch/``, ``select/``, ``experts/``, ``observe/``) import
  nothing above them: not ``graphs/``, ``layer.py``, ``op.py``, ``training/``, ``demo/``, nor the
  top-level ``megatron_lrmoe/__init__.py`` (which imports the layer);
* ``graphs/`` (the CUDA graphs that capture the stages' launches) is a floor of its own between
  the stages and ``op/``: it may import the stages and the ground-floor modules, nothing above
  it (``layer.py``, ``op/``, ``training/``, ``demo/``, the top-level ``__init__.py``).

An upward import that cannot be removed yet goes into :data:`ALLOWED`, with its reason; an entry
that no longer occurs fails the test, so that the list only shrinks.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "megatron_lrmoe"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

STAGES = ("control", "dispatch", "select", "experts", "observe")
GRAPHS = "graphs"
ABOVE_STAGES = ("layer", "op", "training", "demo")
CONTROL_MUST_NOT = ("dispatch", "select", "experts", "op", "layer")

# (importer, imported) edges that break a floor but stay for now, each with its reason. Module
# names are dotted and relative to the package ("select.scoring"). Empty: keep it that way.
ALLOWED: dict[tuple[str, str], str] = {}


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, whether it is a package ``__init__``)."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = [PACKAGE, *path.relative_to(ROOT).with_suffix("").parts]
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        found[".".join(parts)] = (path, is_package)
    return found


MODULES = _modules()


def _owner(name: str) -> str:
    """The package module that ``name`` (a module or a name inside one) lives in."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _imports(module: str) -> tuple[set[str], set[str]]:
    """``(intra-package modules imported, other modules imported)`` by ``module``, anywhere in it."""
    path, is_package = MODULES[module]
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if is_package else module.rpartition(".")[0]
    inside, outside = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{alias.name}" for alias in node.names]
            if not source.startswith(PACKAGE):
                outside.update([source, *targets])
                continue
        else:
            continue
        for target in targets:
            if target == PACKAGE or target.startswith(PACKAGE + "."):
                inside.add(_owner(target))
            else:
                outside.add(target)
    inside.discard(module)
    return inside, outside


GRAPH = {module: _imports(module)[0] for module in MODULES}


def _short(module: str) -> str:
    return module[len(PACKAGE) + 1 :] if module != PACKAGE else "__init__"


def _under(module: str, *prefixes: str) -> bool:
    short = _short(module)
    return any(short == p or short.startswith(p + ".") for p in prefixes)


def _violations() -> dict[tuple[str, str], str]:
    """Every edge that breaks a floor, with the rule it breaks."""
    found = {}
    for module, targets in GRAPH.items():
        for target in targets:
            edge = (_short(module), _short(target))
            if _under(module, "control") and _under(target, *CONTROL_MUST_NOT):
                found[edge] = "control imports a later stage or the layer"
            elif _under(module, "select") and _under(target, "dispatch.comm"):
                found[edge] = "select communicates"
            elif _under(module, *STAGES) and (
                _under(target, GRAPHS, *ABOVE_STAGES) or target == PACKAGE
            ):
                found[edge] = "a stage imports what sits above the stages"
            elif _under(module, GRAPHS) and (_under(target, *ABOVE_STAGES) or target == PACKAGE):
                found[edge] = "graphs import what sits above them"
            elif _under(target, "control.reference") and not _under(module, "control.reference"):
                found[edge] = "production code imports the slow references (tests use them)"
    return found


def _cycles() -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(GRAPH[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(_short(top))
                if top == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(GRAPH):
        if node not in index:
            visit(node)
    return components


def test_the_graph_sees_the_package() -> None:
    """The walk finds the modules and edges it should (guards against a silently empty graph)."""
    assert f"{PACKAGE}.layer" in MODULES and f"{PACKAGE}.select" in MODULES
    assert f"{PACKAGE}.op" in GRAPH[f"{PACKAGE}.layer"]
    assert f"{PACKAGE}.control.controller" in GRAPH[f"{PACKAGE}.layer"]
    assert f"{PACKAGE}.graphs.front" in GRAPH[f"{PACKAGE}.op.stages"]
    assert f"{PACKAGE}.select.select_triton" in GRAPH[f"{PACKAGE}.graphs.front"]


def test_no_import_cycles() -> None:
    assert _cycles() == []


def test_floors_of_the_layout() -> None:
    """Section 6's floors hold, apart from the listed exceptions."""
    unlisted = {edge: rule for edge, rule in _violations().items() if edge not in ALLOWED}
    assert unlisted == {}


def test_allowed_exceptions_still_occur() -> None:
    """Every listed exception is still an import that breaks a floor (remove it once fixed)."""
    stale = sorted(set(ALLOWED) - set(_violations()))
    assert stale == []


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _under(m, "select")))
def test_select_does_not_communicate(module: str) -> None:
    """No ``torch.distributed``, imported or reached as ``torch.distributed.<...>``."""
    _, outside = _imports(module)
    assert not [name for name in outside if name.startswith("torch.distributed")]
    tree = ast.parse(MODULES[module][0].read_text())
    reached = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr == "distributed"
        and isinstance(node.value, ast.Name)
        and node.value.id == "torch"
    ]
    assert reached == []
