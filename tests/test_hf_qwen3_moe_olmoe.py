"""Qwen3-MoE and OLMoE from transformers: a tiny random model of each (no download; every weight perturbed,
the norm weights away from 1) converts with logits equal to transformers' (float32, unsharded and on 2x2),
from both weight layouts (per-expert tensors, as save_pretrained writes, and transformers 5's fused
``gate_up_proj`` / ``down_proj``); `meshlm generate --temperature 0` prints transformers' greedy text on
1x1 and with ``--ep 2``; the export loads back with equal logits; the "hf" load-balancing loss is
transformers'. Qwen3-MoE renormalises its top-k (norm_topk_prob) and has an explicit head_dim; OLMoE does
not renormalise and normalizes q and k over the whole projection."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import haiku as hk  # noqa: E402
from hf_harness import Case, Comparison, GreedyText, family_fixture  # noqa: E402
from hf_helpers import ROPE, TINY, balance_loss_equal_transformers  # noqa: E402

from meshlm.errors import ConfigError  # noqa: E402
from meshlm.io import hf_config  # noqa: E402
from meshlm.model.config import get_config  # noqa: E402
from meshlm.parallel.context import Parallel  # noqa: E402

SHARED = dict(**TINY, num_hidden_layers=2, intermediate_size=48, num_experts=4, num_experts_per_tok=2)
SHARED |= dict(rope_parameters=ROPE, pad_token_id=0)
MOE = dict(fused=True, sharded=("--mesh", "2x1", "--ep", "2"))
family = family_fixture(
    [
        Case(
            "qwen3_moe",
            "Qwen3MoeForCausalLM",
            lambda: transformers.Qwen3MoeConfig(
                moe_intermediate_size=16,
                head_dim=16,
                norm_topk_prob=True,
                router_aux_loss_coef=0.02,
                mlp_only_layers=[0],
                **SHARED,
            ),  # a dense first layer (Qwen2-MoE's rule, two parameter stacks); fmt: skip
            reads=dict(
                moe_d_ff=16,
                d_ff=48,
                head_dim=16,
                norm_topk_prob=True,
                router_aux_loss_coef=0.02,
                dense_layers=(0,),
            ),  # fmt: skip
            **MOE,
        ),
        Case(
            "olmoe",
            "OlmoeForCausalLM",
            lambda: transformers.OlmoeConfig(norm_topk_prob=False, router_aux_loss_coef=0.01, **SHARED),
            reads=dict(moe_d_ff=48, d_ff=48, head_dim=0, norm_topk_prob=False, router_aux_loss_coef=0.01),
            **MOE,
        ),
    ]
)


class TestTransformers(Comparison, GreedyText):
    """Logits unsharded and on 2x2 (and transformers 5's fused in-memory expert tensors read bitwise the
    same), the export, greedy text on 1x1 and 2x1 with --ep 2 (tests/hf_harness.py)."""


def test_hf_balance_loss_is_transformers(family):
    """Our "hf" balance loss of the model's own routing = transformers' load_balancing_loss_func of its
    router logits (every layer's tokens pooled)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    balance_loss_equal_transformers(family["hf"], family["model"], family["tokens"], load_balancing_loss_func)


@pytest.mark.parametrize(
    "preset, change, names",
    [
        ("tiny-qwen3-moe", {"mlp_only_layers": "0"}, "mlp_only_layers must be a list of layer indices"),
        ("tiny-qwen3-moe", {"use_sliding_window": True}, "use_sliding_window"),
        ("tiny-olmoe", {"clip_qkv": 8.0}, "clip_qkv=8.0"),
        ("tiny-olmoe", {"head_dim": 16}, "head_dim=16"),
    ],
)
def test_unsupported_fields_are_named(preset, change, names):
    base = hf_config.config_to_hf(get_config(preset).replace(router_z_loss_coef=0.0))
    with pytest.raises(ConfigError, match=names):
        hf_config.config_from_hf({**base, **change})


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "olmoe-1b-7b"])
def test_preset_config_round_trip(preset):
    cfg = get_config(preset)
    assert hf_config.config_from_hf(hf_config.config_to_hf(cfg)) == cfg


@pytest.mark.parametrize("preset", ["tiny-olmoe", "tiny-olmo2"])
def test_whole_projection_qk_norm_rounds_as_transformers_in_bf16(preset):
    """OLMoE's q/k norm casts to bf16 before the weight product (OlmoeRMSNorm), OLMo 2's after it
    (Olmo2RMSNorm): the family's ``Family.norm`` picks, so bf16 outputs are transformers' bit for bit."""
    import jax.numpy as jnp
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
    from transformers.models.olmoe.modeling_olmoe import OlmoeRMSNorm

    from meshlm.model.attention import QK_NORMS, Attention

    cfg = get_config(preset)
    torch.manual_seed(0)
    x, w = torch.randn(5, 16).bfloat16(), (1 + torch.randn(16)).bfloat16()
    theirs = (OlmoeRMSNorm if preset == "tiny-olmoe" else Olmo2RMSNorm)(16, eps=cfg.norm_eps).bfloat16()
    with torch.no_grad():
        theirs.weight.copy_(w)
        want = theirs(x).float().numpy()

    def norm(x):
        args = Attention(cfg=cfg, par=Parallel(), stddev=0.02)._norm_args(False)
        return QK_NORMS["proj"](eps=cfg.norm_eps, name="q_norm", **{**args, "heads": 2})(x)

    as_jax = lambda t: jnp.asarray(t.float().numpy(), jnp.bfloat16)
    params = {"q_norm": {"scale_heads": as_jax(w).reshape(2, 8)}}
    got = hk.transform(norm).apply(params, None, as_jax(x).reshape(5, 1, 2, 8))
    np.testing.assert_array_equal(np.asarray(got, np.float32).reshape(5, 16), want)
