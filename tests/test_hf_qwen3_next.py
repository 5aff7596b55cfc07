"""Qwen3-Next (the hybrid Qwen3.5 grew from: a mixture of experts with a shared expert in every layer, its
own fused in_proj_qkvz / in_proj_ba grouped per key head) from transformers 5: a tiny random
``Qwen3NextForCausalLM`` (every weight perturbed; 2 key heads each serving 2 value heads, so the grouping
matters) converts with logits equal to transformers' (float32; unsharded and on 2x2; 20 tokens: three
chunks of 8), and its export (the groups joined again) loads back in transformers with equal logits and
the same config. One conversion, module-scoped."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers import sharded_logits  # noqa: E402
from hf_helpers import (  # noqa: E402
    RTOL,
    VOCAB,
    export_round_trip,
    hf_logits,
    our_logits,
    perturbed_model,
    random_tokens,
    rel,
)

from meshlm.io import hf_weights  # noqa: E402
from meshlm.model.params import unflatten  # noqa: E402

CHUNK = 8
TOL = 2 * RTOL  # as Qwen3.5's (tests/test_hf_qwen3_5.py): transformers' float32 delta rule


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """{dir, tokens, logits}: layers linear, full (interval 2); 4 experts of 16, 2 per token, a shared
    expert of 24."""
    torch.manual_seed(0)
    cfg = transformers.Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=64, full_attention_interval=2,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25},
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = perturbed_model(transformers.Qwen3NextForCausalLM, cfg)
    root = tmp_path_factory.mktemp("qwen3_next")
    model.save_pretrained(root / "hf")
    tokens = random_tokens(20)
    return dict(dir=root / "hf", tokens=tokens, logits=hf_logits(model, tokens))


def test_converts_with_transformers_logits_unsharded_and_on_2x2(hf):
    cfg, flat = hf_weights.load_hf(hf["dir"])
    assert (cfg.family, cfg.full_attn_every, cfg.linear_layers, cfg.n_experts) == ("qwen3_next", 2, (0,), 4)
    assert (cfg.norm_topk_prob, cfg.shared_expert_d_ff, cfg.rot_dim) == (True, 24, 4)
    assert any(p.startswith("linear_layers/moe/experts/") for p in flat)  # the linear layer's experts
    cfg = cfg.replace(linear_chunk=CHUNK)
    assert rel(our_logits(cfg, flat, hf["tokens"]), hf["logits"]) <= TOL
    for copy in sharded_logits(cfg, unflatten(flat), hf["tokens"]):
        assert rel(copy, hf["logits"]) <= TOL


def test_export_loads_back_equal(hf, tmp_path):
    name, err, same = export_round_trip(hf["dir"], tmp_path, hf["tokens"], hf["logits"])
    assert (name, same) == ("Qwen3NextForCausalLM", True) and err <= TOL
