"""Gemma 4's MoE block (``model.per_layer.block`` with experts: the 26B-A4B's), proven: float64, the
sharded model against the unsharded one on 2x2 with the experts over ep 2 (4 of 8 per shard, their hidden
units over mp), the block's own control (the router reading the experts' normed input, not the residual)
and the router's, the statistics' and ep's detected (measured: 6.2e-15 relative, 0.006 of the tolerance;
the controls 4e9 - 2.5e12 times it). Every other control traces on it (tests/test_every_control.py). The
transformers comparison is tests/test_hf_gemma4.py's "gemma4-moe" case."""

import jax
import jax.numpy as jnp
import pytest

from meshlm.model.config import get_config
from meshlm.parallel.layout import Layout
from meshlm.proof import model_problem, verify
from meshlm.proof.controls import CONTROLS
from meshlm.proof.ep_controls import EP_CONTROLS

EP2 = Layout(dp=2, mp=2, ep=2)
# 2 layers (local, global): per-layer inputs and keys as values kept; no shared KV (it needs 3+)
SMALL = dict(n_layers=2, global_every=2, kv_shared_layers=0)
ROUTER_INPUT = "MoE router reading the experts' normed input, not the residual"


# The block's own control and the router's, the statistics' and the experts' over ep (each control a
# sharded run: the rest of the MoE and ep controls are proven on the other MoE families' cells)
NAMES = (
    ROUTER_INPUT,
    "MoE combine weights not renormalised",
    "MoE aux-loss statistics not summed over the data shards",
    "tokens sent to the neighbouring ep shard",
    "top-k ties broken by shard-local index",
)


# slow: Gemma 4's per-layer stack is proven quick (tests/test_gemma4_global.py) and a MoE block with its
# controls too (tests/test_moe.py): this is their product on ep 2 (its cost)
@pytest.mark.slow
def test_moe_block_proven_on_ep2_with_controls():
    cfg = get_config("tiny-gemma4-moe").replace(**SMALL)
    controls = tuple(c for c in CONTROLS + EP_CONTROLS if c.name in NAMES)  # Gemma 4's in CONTROLS
    problem = model_problem(cfg, "gemma4-moe-ep2", EP2, 2, 8)
    with jax.enable_x64(True):
        report = verify(problem, EP2, dtype=jnp.float64, controls=controls)
    assert sorted(c["name"] for c in report.controls) == sorted(NAMES)
    assert report.ok and all(c["detected"] for c in report.controls), (report.checks, report.controls)


# slow: the collective count of the MoE block (its cost); the communication minimum and its planted extra all-
# reduce: tests/test_prover.py, quick
@pytest.mark.slow
def test_communication_minimum_counts_the_experts_row_sum():
    """Beside the attention's and the MLP's, the experts' partial output is a third row-parallel sum per
    layer (``Family.row_sums``): the communication check's all-reduce bytes on 2x2 (without it the
    measured bytes exceed the minimum by the 2 layers' [1, 8, 64] forward and backward)."""
    cfg = get_config("tiny-gemma4-moe").replace(**SMALL)
    layout = Layout(dp=2, mp=2)
    with jax.enable_x64(True):
        report = verify(model_problem(cfg, "gemma4-moe", layout, 2, 8), layout, dtype=jnp.float64,
                        controls=(), collectives=True)  # fmt: skip
    rows = {c["name"]: c for c in report.checks}
    assert rows["all-reduce bytes per step"]["ok"] and report.ok, rows
