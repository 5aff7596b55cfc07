"""The package layout is the architecture: lower layers never import higher ones, nothing imports the
CLI, and no module or class grows past what a reader takes in at once."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "meshlm"

# What each subpackage may import from meshlm (besides itself and ``meshlm.errors``). Lower layers
# first: the model and the parallel machinery know nothing of training, files, the proof or the CLI.
ALLOWED = {
    "parallel": {"model"},  # the rules table resolves the model's KV-head layout
    "model": {"parallel"},
    "data": {"parallel"},  # device batches are laid out by the rules module's batch shardings
    "train": {"model", "parallel", "data", "io", "generate"},  # the loop saves and samples
    "io": {"model", "parallel"},
    "generate": {"model", "parallel", "data"},
    "proof": {"model", "parallel", "data", "train", "perf"},  # the real step; collective counts
    "perf": {"model", "parallel", "data", "train", "generate", "io"},
    "cli": {"model", "parallel", "data", "train", "io", "generate", "proof", "perf"},
}
MAX_MODULE_LINES = 350
MAX_CLASS_LINES = 120


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


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_module_and_class_sizes(path):
    text = path.read_text()
    assert len(text.splitlines()) <= MAX_MODULE_LINES, f"{path.name}: split it where its parts separate"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef):
            size = node.end_lineno - node.lineno + 1
            assert size <= MAX_CLASS_LINES, f"class {node.name} has {size} lines"


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
    hits = [h for h in _lines_matching(r"mesh\.shape\[") if not h.startswith("parallel/layout.py")]
    assert hits == []
