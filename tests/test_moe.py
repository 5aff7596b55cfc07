"""The mixture-of-experts layer (``model.moe``) apart from the proof: the routing's tie rule, the two
load-balancing conventions against their definitions, the refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm.errors import ConfigError
from meshlm.model import moe
from meshlm.model.config import get_config
from meshlm.parallel.layout import Layout
from meshlm.sharding.pipelined import check_pipelined

CFG = get_config("tiny-mixtral")


def test_ties_go_to_the_lowest_expert_id():
    logits = jnp.array([[0.0, 1.0, 1.0, 2.0], [3.0, 3.0, 3.0, 0.0]])
    _, weights, ids = moe.route(logits, 2, True)
    assert ids.tolist() == [[3, 1], [0, 1]]
    np.testing.assert_allclose(np.sum(weights, -1), 1.0, rtol=1e-6)
    _, raw, _ = moe.route(logits, 2, False)  # not renormalised: the softmax's own values
    np.testing.assert_allclose(
        raw, np.take_along_axis(np.asarray(jax.nn.softmax(logits)), np.asarray(ids), -1)
    )


def _stats(cfg, layers):
    """Per-layer statistics of random router logits [L, N, E], and the logits."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(layers, 12, cfg.n_experts)))
    rows = []
    for lg in logits:
        probs, _, ids = moe.route(lg, cfg.experts_per_token, cfg.norm_topk_prob)
        rows.append(moe.statistics(lg, probs, ids, cfg.n_experts))
    return jnp.stack(rows), logits


def test_balance_losses_are_their_definitions():
    stats, logits = _stats(CFG, 2)
    e, k = CFG.n_experts, CFG.experts_per_token
    probs = jax.nn.softmax(logits, -1)  # [L, N, E]
    chosen = jax.nn.one_hot(jax.lax.top_k(probs, k)[1], e).sum(-2)  # [L, N, E]
    pooled = e * jnp.sum(chosen.mean((0, 1)) * probs.mean((0, 1)))  # transformers': pooled over layers
    assert float(moe.balance_loss(CFG, stats)) == pytest.approx(float(pooled), rel=1e-12)
    per_layer = jnp.mean(e * jnp.sum(chosen.mean(1) / k * probs.mean(1), -1))  # Megatron's
    got = moe.balance_loss(CFG.replace(moe_aux_loss="per-layer"), stats)
    assert float(got) == pytest.approx(float(per_layer), rel=1e-12)
    z = jnp.mean(jnp.square(jax.nn.logsumexp(logits, -1)))
    assert float(moe.z_loss(CFG, stats)) == pytest.approx(float(z), rel=1e-12)


def test_refusals_name_the_field():
    with pytest.raises(ConfigError, match="moe_aux_loss"):
        CFG.replace(moe_aux_loss="megatron")
    with pytest.raises(ConfigError, match="experts_per_token"):
        CFG.replace(experts_per_token=5)
    with pytest.raises(ConfigError, match="dense feed-forward"):
        get_config("tiny-llama").replace(n_experts=4)
    check_pipelined(CFG, Layout(pp=2))  # accepted: the statistics leave the stages (parallel.pipeline_stats)


def test_moe_proven_sharded_with_its_controls_detected():
    """tiny-mixtral on 2x2 in float64: loss and every gradient (router, experts) equal the unsharded
    model's, and the MoE controls detected (on the planted tie)."""
    from helpers import verify_preset

    from meshlm.proof import format_report
    from meshlm.proof.moe_controls import MOE_CONTROLS

    with jax.enable_x64(True):
        report = verify_preset("tiny-mixtral", 2, 2, batch=2, seq=8, dtype=jnp.float64, controls=MOE_CONTROLS)
    assert report.ok and max(p.max_rel_err for p in report.params) <= 1e-12, format_report(report)
    assert len(report.controls) == len(MOE_CONTROLS)
