"""DeepSeek-V3 from transformers 5: a tiny random all-dense ``DeepseekV3ForCausalLM`` (multi-head latent
attention with low-rank queries, a shared rotary key, v_head_dim != the q/k head, interleaved rotary,
YaRN with mscale != mscale_all_dim so both its factors matter) converts with logits equal to
transformers' (float32, unsharded and on 2x2), `meshlm generate --temperature 0` prints transformers'
greedy text on 1x1 and 1x2 (the prompt and text longer than a block), and the export loads back with
equal logits. A config.json with MoE layers (DeepSeek's sigmoid router: not built) is one line."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_harness import Case, Comparison, GreedyText, drift, family_fixture  # noqa: E402
from hf_helpers import RTOL, VOCAB  # noqa: E402

from meshlm.errors import ConfigError  # noqa: E402
from meshlm.io import hf_config  # noqa: E402
from meshlm.model import mla  # noqa: E402

ROPE = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 16}
ROPE |= {"mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 32, "beta_slow": 1}


def _hf_config(**changes):
    fields = dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
        first_k_dense_replace=2, max_position_embeddings=64, rope_parameters=ROPE, bos_token_id=0,
        eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return transformers.DeepseekV3Config(**{**fields, **changes})


family = family_fixture(
    [
        Case(
            "deepseek_v3",
            "DeepseekV3ForCausalLM",
            _hf_config,
            reads=dict(family="deepseek_v3_dense", mla=True, head_dim=12, rot_dim=4, v_head_dim=6),
        )
    ]
)


class TestTransformers(Comparison, GreedyText):
    """Logits unsharded and on 2x2, the export, greedy text on 1x1 and 1x2 (tests/hf_harness.py)."""


def test_a_shared_yarn_bug_fails_the_transformers_comparison(family, monkeypatch):
    """The YaRN attention factor on q only: both verify's runs would share it, transformers' logits tell."""
    planted = lambda x, cos, sin, scale, style, query: mla.apply_rotary(
        x, cos * (scale if query else 1.0), sin * (scale if query else 1.0), x.shape[-1], style
    )
    monkeypatch.setattr(mla, "rotate_pair", planted)
    assert drift(family) > 100 * RTOL


def test_moe_router_and_plain_queries_are_one_line():
    hf = _hf_config(first_k_dense_replace=1).to_dict()
    with pytest.raises(ConfigError, match=r"first_k_dense_replace=1 .* DeepSeek's MoE router .* not built"):
        hf_config.config_from_hf(hf)
    with pytest.raises(ConfigError, match=r"q_lora_rank=None"):
        hf_config.config_from_hf({**_hf_config().to_dict(), "q_lora_rank": None})
