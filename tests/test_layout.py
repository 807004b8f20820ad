"""The code's shape, checked: module size, import cycles, private names across modules.

Issue 11 asked for modules of one concept (none over about 400 lines),
no import cycles (none hidden by function-local imports either) and no
private names imported from another module. These tests read the source
(ast, nothing imported), so they hold for code paths no other test runs.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("server", "client", "connector")
# "About 400 lines": a module may run a little over while it holds one concept.
MAX_LINES = 430


def _modules() -> Dict[str, Path]:
    """kvkeeper module name -> file, for our packages (generated stubs aside)."""
    out: Dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if "_pb2" in path.name:
                continue
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(["kvkeeper", *parts])] = path
    return out


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _type_checking_only(tree: ast.Module) -> Set[int]:
    """ids of import nodes under `if TYPE_CHECKING:` (not run, so no cycle)."""
    skip: Set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                for inner in ast.walk(sub):
                    skip.add(id(inner))
    return skip


def _imports(name: str) -> Iterator[Tuple[str, List[str], int]]:
    """(imported kvkeeper module, names taken from it, line) for every import
    in module `name`, function-local ones included."""
    tree = ast.parse(MODULES[name].read_text(), str(MODULES[name]))
    skip = _type_checking_only(tree)
    base = name.split(".") if _is_package(name) else name.split(".")[:-1]
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("kvkeeper."):
                    yield alias.name, [], node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parent = base[:len(base) - node.level + 1]
                target = ".".join(parent + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("kvkeeper"):
                yield target, [a.name for a in node.names], node.lineno


def _edges() -> Dict[str, Set[str]]:
    graph: Dict[str, Set[str]] = {m: set() for m in MODULES}
    for name in MODULES:
        for target, names, _ in _imports(name):
            subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES]
            deps = subs if subs and len(subs) == len(names) else [target] + subs
            for dep in deps:
                if dep in MODULES and dep != name:
                    graph[name].add(dep)
    return graph


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    out: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _same_package(a: str, b: str) -> bool:
    """Whether one module is a package and the other inside it: a package's
    __init__ may expose its parts' names, and its parts may use its names."""
    return (b.startswith(a + ".") and _is_package(a)) or (a.startswith(b + ".") and _is_package(b))


def test_the_checker_sees_our_modules() -> None:
    # Guards the tests below against passing vacuously on an empty tree.
    assert "kvkeeper.server.ledger.ledger" in MODULES or "kvkeeper.server.ledger" in MODULES
    assert len(MODULES) > 50
    assert any(_edges().values())


def test_no_module_is_over_about_400_lines() -> None:
    big = {str(p.relative_to(ROOT)): n for p in MODULES.values()
           if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines (split them along their concepts): {big}"


def test_no_import_cycles() -> None:
    cycles = _cycles(_edges())
    assert not cycles, f"import cycles (function-local imports count): {cycles}"


def test_no_private_names_imported_across_modules() -> None:
    bad = []
    for name in MODULES:
        for target, names, line in _imports(name):
            for n in names:
                if n.startswith("_") and not n.startswith("__") and \
                        not _same_package(name, target):
                    bad.append(f"{MODULES[name].relative_to(ROOT)}:{line} imports {n} from {target}")
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)


@pytest.mark.parametrize("src, cycle", [
    ({"a": {"b"}, "b": {"a"}}, True),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, False),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, True),
])
def test_cycle_finder(src: Dict[str, Set[str]], cycle: bool) -> None:
    assert bool(_cycles(src)) is cycle
