"""Qwen3.5-MoE and Qwen3-Next (text) from transformers 5: the Qwen3.5 hybrid with a mixture of experts and
a shared expert in every layer, the linear-attention layers' too; Qwen3-Next (the hybrid Qwen3.5 grew
from) with its own fused in_proj_qkvz / in_proj_ba grouped per key head (2 key heads each serving 2 value
heads, so the grouping matters). Each tiny random model (every weight perturbed) converts with logits
equal to transformers' (float32; unsharded and on 2x2; 20 tokens: three chunks of 8), and its export
(the groups joined again) loads back in transformers with equal logits and the same config
(tests/hf_harness.py). One conversion per model, module-scoped."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_harness import Case, Comparison, family_fixture  # noqa: E402
from hf_helpers import RTOL, VOCAB  # noqa: E402

CHUNK = 8
TOL = 2 * RTOL  # as Qwen3.5's (tests/test_hf_qwen3_5.py): transformers' float32 delta rule

# layers linear, full (interval 2); 4 experts of 16, 2 per token, a shared expert of 24
HYBRID_MOE = dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, max_position_embeddings=64, full_attention_interval=2,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
    rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25},
    bos_token_id=0, eos_token_id=0,
)  # fmt: skip
READS = dict(full_attn_every=2, linear_layers=(0,), n_experts=4, norm_topk_prob=True, shared_expert_d_ff=24)


def _case(name, model_cls, config_cls):
    return Case(
        name,
        model_cls,
        lambda: getattr(transformers, config_cls)(**HYBRID_MOE),
        reads=dict(READS, rot_dim=4),
        length=20,
        change=dict(linear_chunk=CHUNK),
        tol=TOL,
        generate=False,
    )


family = family_fixture(
    [
        _case("qwen3_5_moe", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig"),
        _case("qwen3_next", "Qwen3NextForCausalLM", "Qwen3NextConfig"),
    ]
)


class TestTransformers(Comparison):
    """Logits unsharded and on 2x2, the export (tests/hf_harness.py)."""


def test_the_linear_layers_have_experts(family):
    flat = family["case"].load(family["hf"])[1]
    assert any(p.startswith("linear_layers/moe/experts/") for p in flat)
