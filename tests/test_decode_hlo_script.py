"""``scripts/decode_hlo.py`` (issue 64: a decode step read from its optimized HLO, offline) runs on this
host at tiny size: the kernels of one step of the chunk's loop, no relayout of the (flat) cache at the
program's entry or exit, and no estimate where the compiler gives none (XLA:CPU); and the cache's slots
(``programs.slots_for``) round up to the tile, never past the context nor under a prefill over cp."""

import json
import runpy
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "decode_hlo.py"


def test_decode_hlo_reads_the_step(monkeypatch, capsys):
    argv = [str(SCRIPT), "--config", "tiny-llama", "--batch", "2", "--prompt", "16", "--new", "9"]
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_path(str(SCRIPT), run_name="__main__")
    out = capsys.readouterr().out
    r = json.loads(out.strip().splitlines()[-1])
    assert r["kernels_per_step"] >= r["fusions_per_step"] > 0 and r["cache_relayouts"] == []
    assert isinstance(r["layer_cache_copies"], list)  # on CPU a slice of the tiny cache is one too
    assert r["estimated_us_per_step"] is None and r["roofline_bytes"] > 0  # XLA:CPU estimates nothing
    assert "kernels a step" in out


def test_slots_round_up_to_the_tile_within_the_context():
    from meshlm.generate.programs import SLOT_TILE, slots_for
    from meshlm.model.config import get_config

    cfg = get_config("tiny-llama").replace(max_seq_len=64)
    assert [slots_for(cfg, n) for n in (1, 16, 17, 25, 50, 64)] == [16, 16, 32, 32, 64, 64]
    assert slots_for(cfg.replace(max_seq_len=60), 50) == 50  # 64 would pass the context: as asked
    assert slots_for(cfg, 25, prefill_cp=True) == 25 and SLOT_TILE == 16


def test_a_copy_of_a_layers_values_is_found():
    """``layer_copies`` on the ops XLA:TPU made at batch 1 with the values' matmul fused (compile-only
    v5e, prompt 4096, ``MESHLM_FLAT_VALUES=fused``): the layer's values transposed and copied back; not
    the stacked cache's in-place write, nor a step's [1, 12, 768] output."""
    sys.path.insert(0, str(SCRIPT.parent))
    from decode_hlo import layer_copies

    def op(opcode, shape):
        return {"opcode": opcode, "shape": shape}

    ops = [
        op("custom-call", "bf16[8,1,4176,768]{3,2,1,0:T(8,128)(2,1)}"),
        op("fusion", "bf16[768,4176]{0,1:T(8,128)(2,1)S(1)}"),
        op("copy", "bf16[768,4176]{1,0:T(8,128)(2,1)S(1)}"),
        op("fusion", "(bf16[1,13,768]{2,1,0}, f32[12]{0})"),
        op("fusion", "bf16[12,4176]{1,0:T(8,128)(2,1)}"),
    ]
    assert layer_copies(ops, (8, 1, 4176, 768)) == ["fusion bf16[768,4176]", "copy bf16[768,4176]"]
    assert layer_copies(ops[:1] + ops[3:], (8, 1, 4176, 768)) == []
