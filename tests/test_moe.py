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
    with pytest.raises(ConfigError, match="--pp"):
        check_pipelined(CFG, Layout(pp=2))


def test_dense_layers_among_moe_layers():
    """dense_layers: one-line refusals; the stack's runs of same-kind layers; --pp refused in one line
    naming what to use; the two stacks' parameters; the gradient under remat with a rolled scan traces."""
    import haiku as hk

    from meshlm.model.layer_kinds import runs
    from meshlm.model.params import flat_params
    from meshlm.model.transformer import loss_fn
    from meshlm.parallel.context import Parallel

    cfg = get_config("tiny-qwen2-moe")
    for bad, match in (([3], "beyond n_layers=3"), ([0, 1, 2], "every layer dense"), ([1, 1], "distinct")):
        with pytest.raises(ConfigError, match=match):
            cfg.replace(dense_layers=bad)
    with pytest.raises(ConfigError, match="dense_layers"):
        get_config("tiny-llama").replace(dense_layers=[0])
    assert runs(cfg.replace(n_layers=5, dense_layers=[0, 2, 3])) == [
        ("dense_layers", 0, 0, 1), ("layers", 1, 0, 1), ("dense_layers", 2, 1, 3), ("layers", 4, 1, 2)
    ]  # fmt: skip
    with pytest.raises(ConfigError, match="pipeline stages hold uniform layers; drop --pp"):
        check_pipelined(cfg, Layout(pp=3))
    cfg = cfg.replace(n_layers=2)  # dense layer 0, MoE layer 1
    batch = {k: jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 8))) for k in ("inputs", "targets")}
    params = jax.eval_shape(hk.transform(loss_fn(cfg, Parallel())).init, jax.random.PRNGKey(0), batch)
    assert flat_params(params)["dense_layers/mlp/w_gate"].shape == (1, 64, 64)
    remat = cfg.replace(remat="full", unroll=1)  # each run's scan rolled, its layers recomputed
    grad = jax.grad(hk.transform(loss_fn(remat, Parallel())).apply)
    assert jax.tree.map(jnp.shape, jax.jit(grad).trace(params, None, batch).out_info) == jax.tree.map(
        jnp.shape, params
    )


def test_moe_proven_sharded_with_its_controls_detected():
    """A MoE model with every part (tiny-qwen2-moe's dense layer 0 and a MoE layer with a shared expert,
    its top-k renormalised) on 2x2 in float64: loss and every gradient (router, experts, shared expert
    and its gate, the dense layer) equal the unsharded model's, and every MoE control detected (on the
    planted tie)."""
    from helpers import verify_preset

    from meshlm.proof import format_report
    from meshlm.proof.moe_controls import MOE_CONTROLS

    cfg = get_config("tiny-qwen2-moe").replace(n_layers=2, norm_topk_prob=True)
    with jax.enable_x64(True):
        report = verify_preset(
            "tiny-qwen2-moe", 2, 2, batch=2, seq=8, dtype=jnp.float64, cfg=cfg, controls=MOE_CONTROLS
        )
    assert report.ok and max(p.max_rel_err for p in report.params) <= 1e-12, format_report(report)
    assert len(report.controls) == len(MOE_CONTROLS) - 1  # but the one of norm_topk_prob off (OLMoE)
