"""``scripts/decode_profile.py`` (issue 64: a decode step's compiled cost, memory and a profile summary,
on the chip) runs on CPU at its smoke size: the cost and memory of both programs, the roofline's bytes,
and a trace whose device ops are summarised by self time."""

import json
import runpy
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "decode_profile.py"


def test_decode_profile_smoke(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--cpu-smoke", "--out", str(tmp_path)])
    runpy.run_path(str(SCRIPT), run_name="__main__")
    captured = capsys.readouterr()
    r = json.loads(captured.out.strip().splitlines()[-1])
    assert r["config"] == "tiny-llama" and r["trace"]["steps"] == 8
    assert list(r["cost_per_step"]) == ["chunk"]  # the programs it runs: no single-step one compiled
    assert r["cost_per_step"]["chunk"]["flops"] > 0 and r["cost_per_step"]["chunk"]["bytes_accessed"] > 0
    assert r["memory"]["chunk"]["argument"] >= r["roofline"]["params_bytes"]
    assert r["trace"]["ops_per_step"] >= 1 and r["trace"]["median_op_us"] >= 0
    assert r["roofline"]["bytes"] > r["roofline"]["params_bytes"] > 0 and r["roofline"]["ms"] is None  # CPU
    top = r["trace"]["top_ops"]
    assert 0 < len(top) <= 15 and all(o["ms_per_step"] >= 0 and o["calls"] > 0 for o in top)
    assert 0 < r["trace"]["device_ms_per_step"] and sum(o["share"] for o in top) <= 1 + 1e-9
    assert "top ops:" in captured.err and list(tmp_path.glob("**/*perfetto_trace.json.gz"))


def test_self_times_count_nested_spans_once():
    """A loop span holding two ops: the ops keep their time, the loop only its own."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from decode_profile import self_times
    finally:
        sys.path.remove(str(SCRIPT.parent))
    spans = [
        {"pid": 1, "tid": 1, "ts": 0, "dur": 10, "name": "while"},
        {"pid": 1, "tid": 1, "ts": 1, "dur": 3, "name": "a"},
        {"pid": 1, "tid": 1, "ts": 5, "dur": 4, "name": "b"},
        {"pid": 1, "tid": 2, "ts": 2, "dur": 5, "name": "c"},
    ]
    assert sorted(self_times(spans)) == [("a", 3.0), ("b", 4.0), ("c", 5.0), ("while", 3.0)]
