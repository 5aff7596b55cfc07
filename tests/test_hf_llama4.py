"""Llama 4 (text) from transformers: a tiny random model (no download; every weight perturbed) with chunks
of 4 under a 16-token text on the rotated layers (L2-normed q/k, Meta's complex-pair rotary), a NoPE
fourth layer with the attention temperature (floor 4: it steps inside the text), and the MoE on every
second layer (top-1, its sigmoid on the token before the expert, a shared expert; experts of 16 units,
dense layers of 48) converts with logits equal to transformers' (float32, unsharded and on 2x2);
`meshlm generate --temperature 0` prints transformers' greedy text on 1x1 and 1x2 (the chunked layers'
KV cache holds one chunk); the export loads back with equal logits. The L2 norm and the temperature
each fail the comparison when dropped; Scout's llama3 rope scaling (a step) reads and writes."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_harness import Case, Comparison, GreedyText, drift, family_fixture, kv_slots  # noqa: E402
from hf_helpers import RTOL, VOCAB  # noqa: E402

from meshlm.errors import ConfigError  # noqa: E402
from meshlm.io import hf_config  # noqa: E402
from meshlm.model.config import get_config  # noqa: E402

HF = dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, intermediate_size=16, intermediate_size_mlp=48,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=1,
    interleave_moe_layer_step=2, attention_chunk_size=4, floor_scale=4, attn_scale=0.1,
    max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
    router_aux_loss_coef=0.02, bos_token_id=0, eos_token_id=0, pad_token_id=0,
)  # fmt: skip


family = family_fixture(
    [
        Case(
            "llama4",
            "Llama4ForCausalLM",
            lambda: transformers.Llama4TextConfig(**HF),
            reads=dict(dense_layers=(0, 2), d_ff=48, moe_d_ff=16, attn_chunk=4, global_every=4)
            | dict(global_nope=True, qk_l2_norm=True, attn_floor_scale=4.0, weights_on_input=True),
            generated=kv_slots(4, 12),  # the chunked layers hold their chunk of 4, the NoPE one the context
        )
    ]
)


class TestTransformers(Comparison, GreedyText):
    """Logits unsharded and on 2x2, the export, greedy text on 1x1 and 1x2 (tests/hf_harness.py)."""


def test_the_l2_norm_and_the_temperature_each_matter(family):
    for dropped in (dict(qk_l2_norm=False), dict(attn_floor_scale=0.0, attn_temp_scale=0.0)):
        assert drift(family, **dropped) > 100 * RTOL


def test_config_refusals_and_round_trip():
    cfg, scout = get_config("tiny-llama4"), get_config("llama4-scout")
    assert hf_config.config_from_hf(hf_config.config_to_hf(cfg)) == cfg
    # Scout's llama3 rope scaling (high_freq_factor = low_freq_factor: a step, no ramp) reads and writes
    assert hf_config.config_to_hf(scout)["rope_parameters"]["high_freq_factor"] == 1.0
    assert hf_config.config_from_hf(hf_config.config_to_hf(scout)).rope_scaling == scout.rope_scaling
    base = hf_config.config_to_hf(cfg)
    with pytest.raises(ConfigError, match="router_jitter_noise"):
        hf_config.config_from_hf({**base, "router_jitter_noise": 0.1})
    with pytest.raises(ConfigError, match="experts_per_token=1"):
        hf_config.config_from_hf({**base, "num_experts_per_tok": 2})
