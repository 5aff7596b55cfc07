"""The package layout is the architecture: lower layers never import higher ones, nothing imports the
CLI, and no module or class grows past what a reader takes in at once."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "meshlm"

# What each subpackage may import from meshlm (besides itself and ``meshlm.errors``). Lower layers
# first: the parallel ground floor (axes, the ``Parallel`` context, ``Layout``, placement) imports no
# other package; the model builds on it; the rules table and the shard_map'd loss (``sharding``) read
# the model; nothing below training knows of training, files, the proof or the CLI.
ALLOWED = {
    "parallel": set(),
    "model": {"parallel"},  # layers compute in the ``Parallel`` context
    "sharding": {"model", "parallel"},  # the rules table resolves the model's KV-head layout
    "data": {"parallel"},  # device batches are placed by the ground floor's batch shardings
    "io": {"model", "parallel", "sharding"},
    "generate": {"model", "parallel", "sharding", "data"},
    "train": {"model", "parallel", "sharding", "data", "io", "generate"},  # the loop saves and samples
    "proof": {"model", "parallel", "sharding", "data", "train", "perf"},  # the real step; collective counts
    "perf": {"model", "parallel", "sharding", "data", "train", "generate", "io"},
    "cli": {"model", "parallel", "sharding", "data", "train", "io", "generate", "proof", "perf"},
}
# A module holds one concern, which a reader takes in whole: 600 lines. (The cap was 350, and a dozen
# modules sat at 339-350, some concerns cut in two by the cap alone.) Data tables are exempt: a
# module-level assignment of a literal table (a dict, list, tuple or set display: the rows of
# something) is read a row at a time, so its lines do not count (``code_lines``).
MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 120
TABLES = (ast.Dict, ast.List, ast.Tuple, ast.Set)


def _modules():
    return sorted(p for p in SRC.rglob("*.py"))


def _package(path: Path) -> str:
    rel = path.relative_to(SRC).parts
    return rel[0] if len(rel) > 1 else ""


def _meshlm_imports(path: Path) -> set[str]:
    """Top-level meshlm subpackages that ``path`` imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "meshlm" and len(parts) > 1 and (SRC / parts[1]).is_dir():
                found.add(parts[1])
    return found


def package_graph() -> dict[str, set[str]]:
    """Package -> the other meshlm packages its modules import (module level or in functions)."""
    graph: dict[str, set[str]] = {}
    for path in _modules():
        pkg = _package(path)
        if pkg:
            graph.setdefault(pkg, set()).update(_meshlm_imports(path) - {pkg})
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A dependency cycle of ``graph`` as [a, b, ..., a], or None (depth-first search)."""
    state: dict[str, str] = {}  # "open" while on the search path, "done" once every successor is

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                return path[path.index(dep) :] + [dep]
            if dep not in state and (cycle := visit(dep, [*path, dep])):
                return cycle
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node, [node])):
            return cycle
    return None


def test_no_package_cycle():
    """No package imports one that imports it back, directly or through others: no exceptions."""
    assert find_cycle(package_graph()) is None, f"package cycle: {' -> '.join(find_cycle(package_graph()))}"
    assert find_cycle(ALLOWED) is None  # the intended layering is a ladder too


def test_the_cycle_check_finds_planted_cycles():
    """The checker fails on a cycle: a real package graph with one planted back edge, and a long one."""
    graph = {pkg: set(deps) for pkg, deps in package_graph().items()}
    assert find_cycle(graph) is None
    graph["parallel"].add("model")  # what ``parallel.rules`` importing the model used to be
    assert find_cycle(graph) in (["model", "parallel", "model"], ["parallel", "model", "parallel"])
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_layering():
    bad = []
    for path in _modules():
        pkg = _package(path)
        if not pkg:
            continue
        for dep in _meshlm_imports(path) - {pkg}:
            if dep not in ALLOWED[pkg]:
                bad.append(f"{path.relative_to(SRC)} imports meshlm.{dep}")
    assert not bad, "layering violated:\n" + "\n".join(bad)


def test_nothing_imports_the_cli():
    importers = [
        str(p.relative_to(SRC))
        for p in _modules()
        if _package(p) != "cli" and p.name != "__main__.py" and "cli" in _meshlm_imports(p)
    ]
    assert importers == []


def test_every_subpackage_is_in_the_table():
    packages = {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages == set(ALLOWED)


def code_lines(text: str) -> int:
    """``text``'s lines less those of its module-level literal tables (``TABLES``)."""
    tables = 0
    for node in ast.parse(text).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, TABLES):
            tables += node.end_lineno - node.lineno + 1
    return len(text.splitlines()) - tables


def test_a_data_table_is_exempt_and_code_is_not():
    """A 700-row table passes the cap; the same rows as statements, or a table inside a function, fail."""
    rows = "".join(f"    {i}: 'row',\n" for i in range(700))
    assert code_lines(f"import x\n\nTABLE = {{\n{rows}}}\n") == 2
    assert code_lines(f"TABLE: dict = {{\n{rows}}}\n") == 0
    assert code_lines("".join(f"x{i} = {i}\n" for i in range(700))) == 700  # scalars are code
    assert code_lines(f"def f():\n    return {{\n{rows}    }}\n") == 703


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_module_and_class_sizes(path):
    text = path.read_text()
    assert code_lines(text) <= MAX_MODULE_LINES, f"{path.name}: split it where its parts separate"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef):
            size = node.end_lineno - node.lineno + 1
            assert size <= MAX_CLASS_LINES, f"class {node.name} has {size} lines"


def module_graph(src: Path = SRC) -> dict[str, set[str]]:
    """Module -> the meshlm modules it imports (module level or in functions): ``from meshlm.a import b``
    is module ``meshlm.a.b`` when that is a module, else ``meshlm.a``."""
    names = {}
    for path in sorted(src.rglob("*.py")):
        parts = path.relative_to(src.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps |= {
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in names else node.module
                    for a in node.names
                }
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        graph[name] = {d for d in deps if d in names and d != name}
    return graph


def mutual_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Every pair of modules that import each other (a two-module cycle), sorted."""
    return sorted((a, b) for a in graph for b in graph[a] if a < b and a in graph.get(b, ()))


def test_no_two_modules_import_each_other():
    """No module imports one that imports it back (e.g. ``Layout`` and ``Parallel`` used to)."""
    pairs = mutual_imports(module_graph())
    assert pairs == [], f"modules importing each other: {pairs}; move what both need into one of them"


def test_the_module_check_finds_a_planted_pair(tmp_path):
    """The check sees a planted pair, one of the edges inside a function, and names it once."""
    pkg = tmp_path / "meshlm" / "sub"
    pkg.mkdir(parents=True)
    (tmp_path / "meshlm" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from meshlm.sub.b import thing\n")
    (pkg / "b.py").write_text("def f():\n    from meshlm.sub import a\n")
    (pkg / "c.py").write_text("import meshlm.sub.a\n")
    graph = module_graph(tmp_path / "meshlm")
    assert mutual_imports(graph) == [("meshlm.sub.a", "meshlm.sub.b")]
    graph["meshlm.sub.b"].clear()
    assert mutual_imports(graph) == []


def test_checker_sees_function_level_imports(tmp_path):
    """The import scan must see lazy imports inside functions (the CLI's and the library's habit)."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from meshlm.train.loop import train\n    import meshlm.io.hf\n")
    assert _meshlm_imports(module) == {"train", "io"}


def _lines_matching(pattern: str) -> list[str]:
    found = []
    for path in _modules():
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(pattern, line):
                found.append(f"{path.relative_to(SRC)}:{i}: {line.strip()}")
    return found


def test_families_are_looked_up_not_branched_on():
    """A family's facts are its ``Family`` record (``model/family.py``): code outside it never
    compares a family's name, so a new family is a record (plus any new layer code)."""
    hits = [h for h in _lines_matching(r"family\s*(==|!=|in\s)") if not h.startswith("model/family.py")]
    assert hits == []


def test_only_the_layout_reads_a_mesh_shape():
    """Axis sizes travel as a ``Layout``; ``Layout.of`` is the one place a mesh's shape is read."""
    pattern = r"mesh\.shape\[|\.shape\[(DP|MP)\]"  # a mesh's shape read by an axis name
    hits = [h for h in _lines_matching(pattern) if not h.startswith("parallel/layout.py")]
    assert hits == []
