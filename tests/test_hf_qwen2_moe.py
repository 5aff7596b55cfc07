"""Qwen2-MoE from transformers: a tiny random Qwen2MoeForCausalLM (no download; every weight perturbed,
the norm weights away from 1) with a shared expert and a dense first layer (``mlp_only_layers=[0]``)
converts with logits equal to transformers' (float32, unsharded and on 2x2; its fused in-memory
expert tensors read to the same parameters); `meshlm generate
--temperature 0` prints transformers' greedy text on 1x1 and with --ep 2; the export loads back with
equal logits; the "hf" load-balancing loss is transformers' (the sparse layers' router logits pooled)."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_harness import Case, Comparison, GreedyText, family_fixture  # noqa: E402
from hf_helpers import ROPE, TINY, balance_loss_equal_transformers  # noqa: E402

from meshlm.errors import ConfigError  # noqa: E402
from meshlm.io import hf_config, hf_weights  # noqa: E402
from meshlm.model.config import get_config  # noqa: E402

# a shared expert, a dense first layer (mlp_only_layers), no top-k renormalisation
QWEN2_MOE = dict(**TINY, num_hidden_layers=3, intermediate_size=48, num_experts=4, num_experts_per_tok=2)
QWEN2_MOE |= dict(moe_intermediate_size=16, shared_expert_intermediate_size=24, mlp_only_layers=[0])
QWEN2_MOE |= dict(norm_topk_prob=False, rope_parameters=ROPE, router_aux_loss_coef=0.02)
family = family_fixture(
    [
        Case(
            "qwen2_moe",
            "Qwen2MoeForCausalLM",
            lambda: transformers.Qwen2MoeConfig(**QWEN2_MOE),
            reads=dict(dense_layers=(0,), shared_expert_d_ff=24, norm_topk_prob=False),
            fused=True,
            sharded=("--mesh", "2x1", "--ep", "2", "--devices", "2"),
        )
    ]
)


class TestTransformers(Comparison, GreedyText):
    """Logits unsharded and on 2x2 (and transformers 5's fused in-memory expert tensors read bitwise the
    same), the export, greedy text on 1x1 and 2x1 with --ep 2 (tests/hf_harness.py)."""


def test_hf_balance_loss_is_transformers(family):
    """Our "hf" balance loss = transformers' load_balancing_loss_func of its router logits: the sparse
    layers' only (the dense layer 0 has no router, its MLP its own stack), every token of theirs pooled."""
    from transformers.models.qwen2_moe.modeling_qwen2_moe import load_balancing_loss_func

    assert "dense_layers/mlp/w_gate" in hf_weights.load_hf(family["hf"])[1]
    hf, model, tokens = family["hf"], family["model"], family["tokens"]
    assert balance_loss_equal_transformers(hf, model, tokens, load_balancing_loss_func) == 2


def test_qwen2_moe_config_fields():
    """decoder_sparse_step's rule (transformers'), the refusals by name, the presets' round trip."""
    base = hf_config.config_to_hf(get_config("tiny-qwen2-moe").replace(router_z_loss_coef=0.0))
    stepped = hf_config.config_from_hf({**base, "num_hidden_layers": 5, "decoder_sparse_step": 2})
    assert stepped.dense_layers == (0, 2, 4)  # sparse iff (i + 1) % 2 == 0 and i not in [0]
    refused = (("qkv_bias", False), ("shared_expert_intermediate_size", 0), ("use_sliding_window", True))
    for key, value in refused:
        with pytest.raises(ConfigError, match=key):
            hf_config.config_from_hf({**base, key: value})
    for preset in ("qwen2-moe-a2.7b",):
        cfg = get_config(preset)
        assert hf_config.config_from_hf(hf_config.config_to_hf(cfg)) == cfg
