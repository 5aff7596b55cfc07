"""``scripts/moe_hlo.py`` (issue 64: where a MoE step's time goes, from XLA:TPU's optimized HLO): its
reading of an HLO module, on a hand-written one in the compiler's text format (compiling for the chip
needs libtpu, which CI has not)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from moe_hlo import instructions, kind, summary  # noqa: E402

HLO = """HloModule jit_step

%convolution_select_fusion (kernel.2: bf16[2,64,8], activations.2: bf16[2,64,4]) -> bf16[2,4,8] {
  %activations.2 = bf16[2,64,4]{2,1,0} parameter(1)
  %kernel.2 = bf16[2,64,8]{2,1,0} parameter(0)
  ROOT %convolution.1 = bf16[2,4,8]{2,1,0} convolution(%activations.2, %kernel.2), dim_labels=0fb_0io->0bf
}

%fused_dot (p0: f32[16,32], p1: f32[32,8]) -> f32[16,8] {
  %p0 = f32[16,32]{1,0} parameter(0)
  %p1 = f32[32,8]{1,0} parameter(1)
  ROOT %dot.1 = f32[16,8]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%update (q0: f32[16,8]) -> f32[16,8] {
  %q0 = f32[16,8]{1,0} parameter(0)
  ROOT %add.2 = f32[16,8]{1,0} add(%q0, %q0), metadata={op_name="jit(step)/cond/add"}
}

%skip (q1: f32[16,8]) -> f32[16,8] {
  ROOT %q1 = f32[16,8]{1,0} parameter(0)
}

ENTRY %main (a: f32[16,32], b: f32[32,8], k: s32[64], p: pred[]) -> f32[16,8] {
  %a = f32[16,32]{1,0} parameter(0)
  %b = f32[32,8]{1,0} parameter(1)
  %k = s32[64]{0} parameter(2)
  %x = bf16[64,8]{1,0} parameter(3)
  %g = bf16[64,4]{1,0} parameter(4)
  %m = pred[2,64]{1,0} parameter(5)
  %p = pred[] parameter(6)
  %sort.1 = s32[64]{0} sort(%k), dimensions={0}, metadata={op_name="jit(step)/moe/jit(argsort)/sort"}
  %fusion.9 = bf16[2,4,8]{2,1,0} fusion(%x, %g, %m), kind=kOutput, calls=%convolution_select_fusion
  %fusion.1 = f32[16,8]{1,0} fusion(%a, %b), calls=%fused_dot, metadata={op_name="jit(step)/dot_general"}
  ROOT %cond.1 = f32[16,8]{1,0} conditional(%p, %fusion.1, %fusion.1), branch_computations={%skip, %update}
}
"""


def test_moe_hlo_reads_kinds_bytes_and_flops():
    """The entry's instructions and the taken branch of the conditional; a fusion's FLOPs from the dot or
    convolution it calls (2 x output x contraction); XLA:TPU's masked convolution named as such."""
    rows = {r["name"]: r for r in instructions(HLO)}
    assert set(rows) == {"sort.1", "fusion.9", "fusion.1", "add.2"}
    assert rows["fusion.1"]["flops"] == 2 * 16 * 8 * 32 and kind(rows["fusion.1"]) == "matmul"
    assert rows["fusion.1"]["bytes"] == 4 * (16 * 32 + 32 * 8 + 16 * 8)
    # [groups 2, rows 64, 4] x [2, 64, 8]: every row for every group, the mask aside (the masked dense)
    assert rows["fusion.9"]["flops"] == 2 * (2 * 4 * 8) * 64
    assert kind(rows["fusion.9"]) == "grouped matmul (masked dense)"
    assert kind(rows["sort.1"]) == "sort" and kind(rows["add.2"]) == "elementwise, copies, the rest"
    by_kind = summary(list(rows.values()))
    assert by_kind["sort"][0] == 1 and by_kind["matmul"][3] == 2 * 16 * 8 * 32
    assert rows["fusion.1"]["t"] == pytest.approx(rows["fusion.1"]["bytes"] / 819e9)  # bytes-bound here
