"""``scripts/decode_profile.py`` (issue 64: a decode step's compiled cost, memory and a profile summary,
on the chip) runs on CPU at its smoke size: the cost and memory of both programs, the roofline's bytes,
and a trace whose device ops are summarised by self time."""

import json
import runpy
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "decode_profile.py"


def _smoke(monkeypatch, capsys, *args):
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--cpu-smoke", *args])
    runpy.run_path(str(SCRIPT), run_name="__main__")
    captured = capsys.readouterr()
    return json.loads(captured.out.strip().splitlines()[-1]), captured.err


def test_decode_profile_smoke(monkeypatch, capsys, tmp_path):
    r, err = _smoke(monkeypatch, capsys, "--out", str(tmp_path))
    assert r["config"] == "tiny-llama" and r["trace"]["steps"] == 8 and r["chunk"] == 4  # two chunks
    assert list(r["cost_per_step"]) == ["chunk"]  # the programs it runs: no single-step one compiled
    assert r["cost_per_step"]["chunk"]["flops"] > 0 and r["cost_per_step"]["chunk"]["bytes_accessed"] > 0
    assert r["memory"]["chunk"]["argument"] >= r["roofline"]["params_bytes"]
    assert r["trace"]["ops_per_step"] >= 1 and r["trace"]["median_op_us"] >= 0
    assert r["roofline"]["bytes"] > r["roofline"]["params_bytes"] > 0 and r["roofline"]["ms"] is None  # CPU
    top = r["trace"]["top_ops"]
    assert 0 < len(top) <= 15 and all(o["ms_per_step"] >= 0 and o["calls"] > 0 for o in top)
    assert 0 < r["trace"]["device_ms_per_step"] and sum(o["share"] for o in top) <= 1 + 1e-9
    assert r["trace"]["program_ms_per_step"] is None  # a CPU trace has no "XLA Modules" line
    assert "top ops:" in err and list(tmp_path.glob("**/*perfetto_trace.json.gz"))


def test_shrink_keeps_the_layers_and_drops_the_bytes(monkeypatch, capsys):
    """``--shrink``: the model's layers and heads at widths that read almost nothing (the step's floor
    from its ops): llama-100m's weights fall ~150x; the smoke run traces the same steps."""
    from meshlm.model.accounting import param_counts
    from meshlm.model.config import get_config

    cfg = get_config("llama-100m")
    small = _module("decode_profile").shrunk(cfg)
    assert (small.n_layers, small.n_heads) == (cfg.n_layers, cfg.n_heads) and small.d_model == 96
    assert param_counts(small).total * 100 < param_counts(cfg).total
    r, _ = _smoke(monkeypatch, capsys, "--shrink")
    assert r["config"] == "tiny-llama shrunk" and r["trace"]["steps"] == 8


def _module(name):
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(SCRIPT.parent))


def test_program_time_is_the_xla_modules_lines():
    """The device's time inside programs: its "XLA Modules" line's spans, not its ops' line."""
    program_us = _module("decode_profile").program_us
    meta = lambda pid, tid, name: {
        "ph": "M",
        "name": "thread_name",
        "pid": pid,
        "tid": tid,
        "args": {"name": name},
    }
    procs = [
        {"ph": "M", "name": "process_name", "pid": p, "args": {"name": n}}
        for p, n in ((1, "/device:TPU:0"), (2, "/host:CPU"))
    ]
    events = [*procs, meta(1, 1, "XLA Modules"), meta(1, 2, "XLA Ops"), meta(2, 1, "XLA Modules")]
    span = lambda pid, tid, t, dur: {"ph": "X", "pid": pid, "tid": tid, "ts": t, "dur": dur, "name": "x"}
    events += [span(1, 1, 0, 7), span(1, 1, 10, 7), span(1, 2, 1, 2), span(2, 1, 0, 100)]  # the host's apart
    assert program_us(events) == 14.0 and program_us(events[1:]) is None


def test_self_times_count_nested_spans_once():
    """A loop span holding two ops: the ops keep their time, the loop only its own."""
    self_times = _module("decode_profile").self_times
    spans = [
        {"pid": 1, "tid": 1, "ts": 0, "dur": 10, "name": "while"},
        {"pid": 1, "tid": 1, "ts": 1, "dur": 3, "name": "a"},
        {"pid": 1, "tid": 1, "ts": 5, "dur": 4, "name": "b"},
        {"pid": 1, "tid": 2, "ts": 2, "dur": 5, "name": "c"},
    ]
    assert sorted(self_times(spans)) == [("a", 3.0), ("b", 4.0), ("c", 5.0), ("while", 3.0)]


def test_the_top_ops_carry_their_hlo_where_the_trace_has_it():
    """A TPU trace names each op's HLO (``long_name``): the top ops keep it, to be read beside the dump."""
    summarise = _module("decode_profile").summarise
    top = summarise([("a", 10.0), ("b", 5.0), ("a", 2.0)], 2, {"a": "%a = bf16[8] fusion(...)"})["top_ops"]
    assert [o["op"] for o in top] == ["a", "b"] and top[0]["ms_per_step"] == 0.006
    assert top[0]["hlo"] == "%a = bf16[8] fusion(...)" and "hlo" not in top[1]
