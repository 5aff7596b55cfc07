"""``scripts/step_profile.py`` (issues 63, 64: where a training step's time goes, from a device profile of
what ``meshlm bench`` built): bench's JSON first, unchanged, then one profile a built implementation whose
ops, categories and top ops add up; an op's category is the trace's where it names one."""

import importlib.util
import json
import runpy
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "step_profile.py"


def _module():
    spec = importlib.util.spec_from_file_location("step_profile", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_an_ops_category_is_the_traces_else_its_name_less_its_number():
    m = _module()
    assert m.category("fusion.12", "convolution fusion") == "convolution fusion"
    assert m.category("multiply_add_fusion.3", "%x = f32[2] add(...)") == "multiply_add_fusion"
    assert m.category("copy.7", "") == "copy"
    ops = [("a.1", 3000.0), ("a.2", 1000.0), ("b.1", 4000.0)]
    cats = m.categories(ops, {"b.1": "convolution"}, steps=2)
    assert [(c["category"], c["ms_per_step"]) for c in cats] == [("a", 2.0), ("convolution", 2.0)]
    assert sum(c["share"] for c in cats) == pytest.approx(1.0)


@pytest.mark.slow  # ~40 s CPU; the trace reading is decode_profile's (test_decode_profile_smoke, quick)
def test_step_profile_smoke(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--cpu-smoke"])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    assert done.value.code == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    bench, (prof,) = out[0], out[1:]
    assert bench["config"] == "tiny-llama" and bench["impls"] == ["meshlm"]
    assert prof["profile"] == "meshlm" and prof["steps"] == 3 and prof["ops_per_step"] >= 1
    assert 0 < prof["device_ms_per_step"] and prof["wall_ms_per_step"] > 0
    total = sum(c["ms_per_step"] for c in prof["categories"])
    assert total == pytest.approx(prof["device_ms_per_step"], rel=1e-6)
    assert all(o["calls"] > 0 and "hlo" in o for o in prof["top_ops"])
