"""``ModelConfig``'s router and expert fields (``RouterFields``, a base as ``MoEFields`` is): the data of
a mixture of experts' router record (torchtitan's router config) and of its experts' optional pieces,
set by the family (``model.families``) and read by ``model.routers`` (the math: ``Router.of(cfg)``).

This module must not import JAX: configs are validated before devices exist.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshlm.errors import ConfigError
from meshlm.ranges import NON_NEGATIVE_FLOAT, POSITIVE_FLOAT, Range

SCORES = ("softmax", "sigmoid")  # ``model.routers.SCORE``
EXPERT_GLUS = ("swiglu", "geglu")  # ``model.layers.GATED``: the experts' gate activation


@dataclass(frozen=True)
class RouterFields:
    """The router (``model.routers``): scores, the top-k rule, the selection bias, the weights' scaling;
    and the experts' pieces (``model.moe``). Every default is today's softmax top-k of gated-SiLU experts
    (Mixtral, Qwen-MoE, OLMoE); a saved config without these fields predates them and loads as that."""

    # "softmax" over all experts, or "sigmoid" of each logit (DeepSeek-V3, Kimi K2, GLM-4.5)
    router_score: str = "softmax"
    # Group-limited top-k: the E experts in ``n_group`` equal groups, each token's best ``topk_group``
    # groups by the sum of their top-2 (selection) scores, then its top k inside them; 0: plain top-k
    n_group: int = 0
    topk_group: int = 0
    # The combine weights times this (DeepSeek-V3's ``routed_scaling_factor``), after any renormalisation
    routed_scaling_factor: float = 1.0
    # A learned bias on the router's logits (gpt-oss: ``router.bias`` [E])
    router_bias: bool = False
    # Aux-loss-free balancing: experts chosen by score + a per-expert bias (``moe/router/balance_bias``
    # [E] per layer, state outside AdamW), the weights from the unbiased scores; after each step the
    # bias moves by ``moe_bias_rate`` x sign(mean load - load) over the whole global batch (0: frozen)
    balance_bias: bool = False
    moe_bias_rate: float = 0.0
    # Shared experts always on, ungated (DeepSeek-V3: one MLP of n x moe_d_ff units, the sum of n experts)
    n_shared_experts: int = 0
    # Biases on the experts' gate/up and down projections (gpt-oss)
    expert_bias: bool = False
    # The experts' SwiGLU: with ``swiglu_limit`` > 0 gate <= limit and |up| <= limit; with
    # ``swiglu_alpha`` > 0 gpt-oss's (up + 1) * gate * sigmoid(alpha * gate), else silu(gate) * up
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 0.0
    # Llama 4: the chosen expert sees the token times its combine weight, its output unweighted (top-1
    # only: with k > 1 each choice would need its own input)
    weights_on_input: bool = False
    # Gemma 4: the router reads its input RMS-normed without a weight, times a learned ``scale`` [D] and
    # D^-0.5 (``router_norm``); the combine weights times a learned ``expert_scale`` [E] of the chosen
    # experts, after the renormalisation (``expert_scale``)
    router_norm: bool = False
    expert_scale: bool = False
    # The experts' gated activation: "swiglu" silu(gate) * up, "geglu" gelu_tanh(gate) * up (Gemma 4)
    expert_glu: str = "swiglu"


ROUTER_RANGES: dict[str, Range] = {
    "n_group": Range(int, 0, note="0: plain top-k"),
    "topk_group": Range(int, 0, note="0: plain top-k"),
    "routed_scaling_factor": POSITIVE_FLOAT,
    "moe_bias_rate": NON_NEGATIVE_FLOAT,
    "n_shared_experts": Range(int, 0, note="0: none"),
    "swiglu_limit": Range(float, 0, note="0: no clamp"),
    "swiglu_alpha": Range(float, 0, note="0: silu(gate) * up"),
}
_DEFAULTS = RouterFields()


def check_router(cfg) -> None:
    """The router fields agree with each other and with the family (``ModelConfig``'s check)."""
    if not cfg.arch.moe:
        if fields := changed(cfg):
            raise ConfigError(f"{', '.join(fields)} need a mixture-of-experts family; drop them")
        return
    if cfg.router_score not in SCORES:
        raise ConfigError(f"router_score is one of {', '.join(SCORES)}; got {cfg.router_score!r}")
    if bool(cfg.n_group) != bool(cfg.topk_group):
        raise ConfigError(f"set n_group and topk_group together; got {cfg.n_group} and {cfg.topk_group}")
    if cfg.n_group:
        per = cfg.n_experts // cfg.n_group
        if cfg.n_experts % cfg.n_group or per < 2 or cfg.topk_group > cfg.n_group:
            raise ConfigError(
                f"n_group={cfg.n_group} must split n_experts={cfg.n_experts} into groups of >= 2 (their "
                f"top-2 scores rank them) and topk_group={cfg.topk_group} <= n_group"
            )
        if cfg.topk_group * per < cfg.experts_per_token:
            raise ConfigError(
                f"topk_group={cfg.topk_group} groups of {per} experts hold fewer than experts_per_token="
                f"{cfg.experts_per_token}; raise topk_group"
            )
    if cfg.expert_glu not in EXPERT_GLUS:
        raise ConfigError(f"expert_glu is one of {', '.join(EXPERT_GLUS)}; got {cfg.expert_glu!r}")
    if cfg.expert_glu != "swiglu" and (cfg.swiglu_limit or cfg.swiglu_alpha):
        raise ConfigError("swiglu_limit and swiglu_alpha clamp SwiGLU experts: set them to 0")
    if cfg.weights_on_input and cfg.experts_per_token != 1:
        raise ConfigError(
            f"weights_on_input (Llama 4's) needs experts_per_token=1, got {cfg.experts_per_token}"
        )
    if cfg.moe_bias_rate and not cfg.balance_bias:
        raise ConfigError(f"moe_bias_rate={cfg.moe_bias_rate} needs balance_bias=true (the bias it moves)")


def changed(cfg) -> list[str]:
    """The router and expert fields of ``cfg`` not at their defaults (today's softmax top-k)."""
    return [n for n in RouterFields.__dataclass_fields__ if getattr(cfg, n) != getattr(_DEFAULTS, n)]


def check_softmax_export(cfg) -> None:
    """Refuse to export a model whose router or experts a softmax top-k family of transformers (Mixtral,
    Qwen2/3-MoE, OLMoE) cannot express: every ``RouterFields`` field at its default."""
    if fields := changed(cfg):
        raise ConfigError(
            f"transformers' {cfg.family} routes by a softmax top-k of plain gated-SiLU experts: "
            f"{', '.join(f'{n}={getattr(cfg, n)!r}' for n in fields)} cannot be exported; set them to "
            "their defaults"
        )
