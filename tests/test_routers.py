"""The router record (``model/routers.py``) against the routing written out as transformers' DeepSeek-V3
writes it, its tie rule, the experts' pieces (``model/moe.py``), the selection bias's update and the
config's refusals. No proof here (``tests/test_router_proof.py``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm.errors import ConfigError
from meshlm.model import moe, routers
from meshlm.model.config import get_config
from meshlm.model.routers import Router

CPU_MOE = get_config("cpu-moe")


def _deepseek_v3(logits, bias, k, n_group, topk_group, scale):
    """transformers' ``DeepseekV3MoE.route_tokens_to_experts`` in numpy (float64), groups masked to -inf
    (transformers masks them to 0.0: the same choice while every kept score is positive)."""
    scores = 1 / (1 + np.exp(-logits))
    choice = scores + bias
    n, e = choice.shape
    grouped = choice.reshape(n, n_group, e // n_group)
    group_scores = np.sort(grouped, axis=-1)[..., -2:].sum(-1)
    ids = []
    for row, gs in zip(choice, group_scores, strict=True):
        best = np.argsort(-gs, kind="stable")[:topk_group]
        keep = np.repeat(np.isin(np.arange(n_group), best), e // n_group)
        masked = np.where(keep, row, -np.inf)
        ids.append(np.argsort(-masked, kind="stable")[:k])  # stable: ties to the lower id
    ids = np.array(ids)
    weights = np.take_along_axis(scores, ids, -1)
    return ids, weights / (weights.sum(-1, keepdims=True) + 1e-20) * scale


@pytest.mark.parametrize("seed", [0, 1])
def test_sigmoid_groups_and_bias_are_deepseek_v3s(seed):
    with jax.enable_x64(True):
        rng = np.random.default_rng(seed)
        logits, bias = rng.normal(size=(32, 64)), rng.normal(scale=0.1, size=64)
        router = Router(score="sigmoid", n_group=4, topk_group=2, renormalise=True, scaling=2.5)
        scores, weights, ids = router(jnp.asarray(logits), 8, jnp.asarray(bias))
        want_ids, want_w = _deepseek_v3(logits, bias, 8, 4, 2, 2.5)
        np.testing.assert_array_equal(np.asarray(ids), want_ids)
        np.testing.assert_allclose(np.asarray(weights), want_w, rtol=1e-14, atol=0)
        np.testing.assert_allclose(np.asarray(scores), 1 / (1 + np.exp(-logits)), rtol=1e-15)
        groups = np.asarray(ids) // 16  # every choice inside the token's 2 kept groups
        assert all(len(set(g)) <= 2 for g in groups.tolist())


def test_the_bias_chooses_but_never_weighs_and_ties_go_to_the_lower_id():
    logits = jnp.zeros((1, 4))  # every score 0.5
    bias = jnp.array([0.0, 0.1, 0.1, 0.0])  # experts 1 and 2 lead, tied with each other
    _, weights, ids = Router(score="sigmoid", renormalise=False)(logits, 1, bias)
    assert ids.tolist() == [[1]]  # the tie in score + bias goes to the lower id
    np.testing.assert_array_equal(weights, [[0.5]])  # the unbiased score
    _, _, ids = Router(score="sigmoid", n_group=2, topk_group=1, renormalise=False)(logits, 1, bias)
    assert ids.tolist() == [[1]]  # the groups tie too (0.6 each): group 0 first


def test_softmax_top_k_is_todays():
    """Mixtral's rule: the top-k's own values renormalised, ties to the lower id, no scaling."""
    logits = jnp.array([[0.0, 1.0, 1.0, 2.0]])
    _, weights, ids = Router()(logits, 2)
    probs = jax.nn.softmax(logits)
    assert ids.tolist() == [[3, 1]]
    top = jnp.take_along_axis(probs, ids, -1)
    np.testing.assert_array_equal(weights, top / jnp.sum(top, -1, keepdims=True))


def test_gpt_oss_activation_and_clamp():
    """transformers' ``GptOssExperts._apply_gate``: gate clamped above, up on both sides, then
    (up + 1) * gate * sigmoid(alpha * gate)."""
    cfg = CPU_MOE.replace(swiglu_limit=7.0, swiglu_alpha=1.702)
    gate, up = jnp.array([-9.0, 0.5, 9.0]), jnp.array([-9.0, 0.5, 9.0])
    g, u = np.minimum(np.asarray(gate), 7.0), np.clip(np.asarray(up), -7.0, 7.0)
    want = (u + 1) * g / (1 + np.exp(-1.702 * g))
    np.testing.assert_allclose(moe.expert_activation(cfg)(gate, up), want, rtol=1e-6)
    silu = moe.expert_activation(CPU_MOE)(gate, up)
    np.testing.assert_array_equal(silu, jax.nn.silu(gate) * up)  # the default: today's


def test_the_bias_step_moves_each_expert_toward_the_mean():
    counts = jnp.array([[4.0, 2.0, 0.0, 2.0]])  # mean 2
    step = np.float32(1e-3) * np.array([[-1, 0, 1, 0]], np.float32)
    np.testing.assert_array_equal(routers.bias_step(1e-3, counts), step)
    update = routers.balance_update(
        CPU_MOE.replace(n_experts=4, experts_per_token=2, n_group=0, topk_group=0)
    )
    params = {"layers/moe/router": {"balance_bias": jnp.zeros((1, 4)), "w": jnp.ones((1, 2, 4))}}
    stats = jnp.concatenate([counts, jnp.zeros((1, 7))], axis=-1)  # [L, 2E + 3]
    moved = update(params, stats)
    np.testing.assert_array_equal(moved["layers/moe/router"]["balance_bias"], step)
    assert moved["layers/moe/router"]["w"] is params["layers/moe/router"]["w"]
    assert routers.balance_update(CPU_MOE.replace(moe_bias_rate=0.0)) is None  # frozen: no update


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(n_group=0), "set n_group and topk_group together"),
        (dict(n_group=3, topk_group=1), "must split n_experts=64"),
        (dict(n_group=16, topk_group=1), "hold fewer than experts_per_token=8"),
        (dict(balance_bias=False), "moe_bias_rate=0.001 needs balance_bias"),
        (dict(router_score="relu"), "router_score is one of softmax, sigmoid"),
    ],
)
def test_router_fields_are_checked(change, match):
    with pytest.raises(ConfigError, match=match):
        CPU_MOE.replace(**change)


def test_router_fields_need_experts_and_refuse_export():
    with pytest.raises(ConfigError, match="router_score, balance_bias need a mixture-of-experts family"):
        get_config("cpu").replace(router_score="sigmoid", balance_bias=True)
    with pytest.raises(ConfigError, match="cannot be exported"):
        CPU_MOE.arch.hf.check_export(CPU_MOE.replace(n_shared_experts=0))
