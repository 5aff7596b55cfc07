"""A family is one module of ``model.families`` and one line of its registry: the presets are those it
had before (a snapshot), its name is written nowhere else, the converter finds a new family through
the registry, and the modules involved import no circle."""

from __future__ import annotations

import ast
import json
import re
import types
from dataclasses import replace
from pathlib import Path

import pytest
from test_layout import find_cycle

from meshlm.errors import ConfigError
from meshlm.io import hf_config
from meshlm.model import families
from meshlm.model.config import PRESETS, get_config
from meshlm.model.families import FAMILIES, MODULES, by_model_type, llama, preset_fields

SRC = Path(__file__).resolve().parents[1] / "src" / "meshlm"
# Every preset's ModelConfig.to_dict(), in listing order, as written before families were modules.
SNAPSHOT = Path(__file__).with_name("presets_snapshot.json")


def test_presets_are_the_snapshot():
    want = json.loads(SNAPSHOT.read_text())
    assert list(PRESETS) == list(want)
    assert {n: json.loads(json.dumps(c.to_dict())) for n, c in PRESETS.items()} == want


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_a_family_is_its_module(module):
    """Its record, HF names and presets are its module's; its quoted name is in no other file (the
    prototype's "ff" is also its block's name, which the layer code spells)."""
    fam = module.FAMILY
    assert FAMILIES[fam.name] is fam and module.__name__.endswith("." + fam.name)
    records = {fam.name} | {f.name for f in getattr(module, "MORE", ())}  # its module's records
    assert all(get_config(name).family in records for name in module.PRESETS)
    if fam.hf is not None:
        assert by_model_type()[fam.hf.model_type] is fam
    if fam.name == fam.block:
        return
    quoted = re.compile(rf"[\"']{re.escape(fam.name)}[\"']")
    files = {str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if quoted.search(p.read_text())}
    assert files <= {f"model/families/{fam.name}.py", "model/families/__init__.py"}


def test_a_new_family_is_a_module_and_a_registry_line(monkeypatch):
    """A family the registry gains converts from and to transformers with no other edit; its presets
    follow the listed ones."""
    hf = replace(llama.HF, model_type="toy", architecture="ToyForCausalLM")
    toy = types.SimpleNamespace(
        __name__="meshlm.model.families.toy",
        FAMILY=replace(llama.FAMILY, name="toy", hf=hf),
        PRESETS={"tiny-toy": dict(llama.TINY)},
    )
    monkeypatch.setattr(families, "MODULES", (*MODULES, toy))
    monkeypatch.setitem(FAMILIES, "toy", toy.FAMILY)
    fields = preset_fields()
    assert list(fields)[-1] == "tiny-toy" and fields["tiny-toy"]["family"] == "toy"
    cfg = get_config("tiny-llama").replace(family="toy")
    out = hf_config.config_to_hf(cfg)
    assert out["model_type"] == "toy" and out["architectures"] == ["ToyForCausalLM"]
    assert hf_config.config_from_hf(out) == cfg


def test_registry_refusals(monkeypatch):
    twice = types.SimpleNamespace(__name__="x.twice", FAMILY=llama.FAMILY, PRESETS={"tiny-llama": {}})
    monkeypatch.setattr(families, "MODULES", (*MODULES, twice))
    with pytest.raises(ConfigError, match="preset 'tiny-llama' of model.families.twice is defined twice"):
        preset_fields()
    monkeypatch.setattr(families, "MODULES", MODULES)
    monkeypatch.setattr(families, "LISTED", (*families.LISTED, "tiny-typo"))
    with pytest.raises(ConfigError, match=r"LISTED names presets no family module defines: \['tiny-typo'\]"):
        preset_fields()


def _module_graph(packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Module -> the meshlm modules it imports (module level or in functions), within ``packages``."""
    paths = {p: p for pkg in packages for p in (SRC / pkg).rglob("*.py")}
    name = {p: "meshlm." + ".".join(p.relative_to(SRC).with_suffix("").parts) for p in paths}
    name = {p: n.removesuffix(".__init__") for p, n in name.items()}
    known = set(name.values())
    graph = {}
    for path, mod in name.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        graph[mod] = (deps & known) - {mod}
    return graph


def test_no_module_import_circle_in_model_io_data():
    """data.tokenizer <-> data.hf_tokenizer and io.hf_config <-> io.hf_config_export were circles: the
    interface moved down (data.tokenizer_base), the family halves into model.families."""
    graph = _module_graph(("model", "io", "data"))
    assert "meshlm.model.families.llama" in graph["meshlm.model.families"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))
