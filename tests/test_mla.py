"""Multi-head latent attention (``model.mla``) proven equal to the unsharded model in float64 on an
all-dense tiny DeepSeek-V3 (low-rank queries, YaRN with both factors != 1), with its four controls
detected: heads over mp with FSDP and SP (2x2), and context parallelism by the all-gather of the
latent (1x2 x cp 2, blockwise attention of several blocks). The full presets' runs are the CLI's
(docs/models.md). Also: the latent projections' rules rows and the collective minimum's entry."""

import jax
import jax.numpy as jnp
import pytest

from meshlm.model.config import get_config
from meshlm.model.params import flat_params
from meshlm.model.router_fields import RouterFields
from meshlm.model.transformer import param_shapes
from meshlm.parallel.axes import MP
from meshlm.parallel.layout import Layout
from meshlm.perf.collectives import theoretical_collectives
from meshlm.proof.controls import CONTROLS
from meshlm.proof.mla_faults import MLA_CONTROLS
from meshlm.proof.problem import model_problem
from meshlm.proof.prover import verify
from meshlm.sharding.rules import model_specs

MLA_NAMES = {c.name for c in MLA_CONTROLS}
DENSE = dict(family="deepseek_v3_dense", n_experts=0, experts_per_token=0, moe_d_ff=0, dense_layers=[])
DENSE |= dict(n_layers=2)  # the preset has 3 (one dense, two MoE: --pp 2); two dense ones serve MLA
DENSE |= dict(
    mtp_layers=0,  # MLA alone (multi-token prediction: tests/test_mtp.py)
    mtp_weight=0.0,
    router_aux_loss_coef=0.0,
    **{n: getattr(RouterFields(), n) for n in RouterFields.__dataclass_fields__},
)


def _dense_mla(**changes):
    return get_config("tiny-deepseek-v3").replace(**DENSE, **changes)


def test_latent_projections_replicated_and_up_projections_by_heads():
    cfg = get_config("tiny-deepseek-v3")
    specs = flat_params(model_specs(cfg, param_shapes(cfg), Layout(dp=2, mp=2, fsdp=True)))
    assert specs["layers/attn/wq_b"][2] == MP and specs["layers/attn/wkv_b"][2] == MP  # [L, r, H, N + Ev]
    assert specs["layers/attn/wo"][1] == MP
    assert MP not in tuple(specs["layers/attn/wkv_a"]) and MP not in tuple(
        specs["layers/attn/kv_a_norm/scale"]
    )
    # 3 layers and the MTP depth's block (``model.mtp``) x 4 replicated leaves
    assert theoretical_collectives(cfg, 1, 2)["mla_latent_grads"] == 4 * 4


# The quick tier: the 2x2 proof with the two controls of MLA's sharding, its replicated latent norm's
# gradient summed over mp and its one rotary key shared by the heads (each other control recompiles the
# train step)
QUICK_MLA = {"MLA latent norm gradient not summed over mp", "MLA rotary key taken per head"}


@pytest.mark.parametrize(
    "layout, attention, names",
    [
        (Layout(dp=2, mp=2, fsdp=True, sp=True), "plain", QUICK_MLA),
        # slow: every MLA control on 2x2 (the key halves' order, YaRN's factor too) and the same proof under
        # cp (their cost is their scale): MLA's sharding bug class is caught quick by the 2x2-fsdp-sp-quick
        # cell (cp's all-gather: test_cp's, quick)
        pytest.param(Layout(dp=2, mp=2, fsdp=True, sp=True), "plain", MLA_NAMES, marks=pytest.mark.slow),
        pytest.param(
            Layout(mp=2, cp=2, cp_strategy="allgather"), "blockwise", MLA_NAMES, marks=pytest.mark.slow
        ),
    ],
    ids=["2x2-fsdp-sp-quick", "2x2-fsdp-sp", "cp2-allgather-blockwise"],
)
def test_mla_proven_with_its_controls_detected(layout, attention, names):
    cfg = _dense_mla(attention=attention, attn_block=4)
    problem = model_problem(cfg, "tiny-deepseek-v3", layout, 2 * layout.dp, 16)
    controls = tuple(c for c in CONTROLS if c.name in names)
    with jax.enable_x64(True):
        report = verify(problem, layout.mesh, steps=1, dtype=jnp.float64, controls=controls)
    assert report.ok, [c for c in report.checks if not c["ok"]]
    assert max(p.max_rel_err for p in report.params) <= 1e-12
    assert {c["name"] for c in report.controls} == names
    assert all(c["detected"] for c in report.controls), report.controls
