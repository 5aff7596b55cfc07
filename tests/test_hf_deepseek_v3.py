"""DeepSeek-V3 from transformers 5: a tiny random ``DeepseekV3ForCausalLM`` (multi-head latent attention
with low-rank queries, a shared rotary key, v_head_dim != the q/k head, interleaved rotary, YaRN with
mscale != mscale_all_dim so both its factors matter; a dense first layer, then DeepSeek's MoE: sigmoid
scores with a random e_score_correction_bias, 8 experts in 2 groups, routed_scaling_factor, a shared
expert of moe_intermediate_size != intermediate_size) converts with logits equal to transformers'
(float32, unsharded, on 2x2 and on 2x1 with --ep 2), `meshlm generate --temperature 0` prints
transformers' greedy text on 1x1, 1x2 and 2x1 --ep 2 (the prompt and text longer than a block), and the
export loads back with equal logits. An all-dense config.json reads as the dense record."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers import sharded_logits  # noqa: E402
from hf_harness import Case, Comparison, GreedyText, drift, family_fixture  # noqa: E402
from hf_helpers import RTOL, VOCAB, rel  # noqa: E402

from meshlm.errors import ConfigError  # noqa: E402
from meshlm.io import hf_config  # noqa: E402
from meshlm.model import mla, routers  # noqa: E402
from meshlm.model.config import get_config  # noqa: E402
from meshlm.model.params import unflatten  # noqa: E402

ROPE = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 16}
ROPE |= {"mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 32, "beta_slow": 1}


def _hf_config(**changes):
    fields = dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
        first_k_dense_replace=1, max_position_embeddings=64, rope_parameters=ROPE, bos_token_id=0,
        eos_token_id=0, pad_token_id=0, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        moe_intermediate_size=16, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        num_nextn_predict_layers=0,  # transformers saves no MTP tensors (tests/test_mtp.py adds them)
    )  # fmt: skip
    return transformers.DeepseekV3Config(**{**fields, **changes})


def _bias(model):
    """A buffer, not a parameter: perturbed_model leaves it at 0."""
    model.model.layers[1].mlp.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.1)


def _latent_cache(out):
    """generate --json's kv_cache: the latent cache, r + R = 16 + 4 values per token and layer against
    full K/V's 4 heads x (12 + 6)."""
    assert out["kv_cache"]["per_token_layer"] == {"values": 20, "full_kv": 72, "ratio": 3.6}


READS = dict(mla=True, head_dim=12, rot_dim=4, v_head_dim=6, dense_layers=(0,), router_score="sigmoid")
family = family_fixture(
    [
        Case(
            "deepseek_v3",
            "DeepseekV3ForCausalLM",
            _hf_config,
            reads=dict(READS, n_group=2, n_shared_experts=1),
            sharded=("--mesh", "2x1", "--ep", "2", "--devices", "2"),
            generated=_latent_cache,
            prepare=_bias,
        )
    ]
)


class TestTransformers(Comparison, GreedyText):
    """Logits unsharded and on 2x2, the export, greedy text on 1x1 and 2x1 --ep 2 (tests/hf_harness.py)."""


def test_ep_logits_and_shared_bugs(family):
    """The MoE on --ep 2 equals transformers; a bug both verify runs would share fails the comparison:
    the YaRN attention factor on q only, the combine weights read from the bias-shifted scores."""
    cfg, flat = family["case"].load(family["hf"])
    assert "layers/moe/shared_experts/w_gate" in flat and "dense_layers/mlp/w_gate" in flat
    for copy in sharded_logits(cfg, unflatten(flat), family["tokens"], (2, 1), ep=2):
        assert rel(copy, family["logits"]) <= RTOL
    planted = lambda x, cos, sin, scale, style, query: mla.apply_rotary(
        x, cos * (scale if query else 1.0), sin * (scale if query else 1.0), x.shape[-1], style
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mla, "rotate_pair", planted)
        assert drift(family) > 100 * RTOL
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(routers, "combine_scores", lambda scores, choice: choice)
        assert drift(family) > 100 * RTOL


def test_config_fields_and_refusals():
    """An all-dense config.json reads as the dense record; the refusals name their field; the presets
    (DeepSeek-V3's and Kimi K2's router) round-trip through config.json."""
    dense = hf_config.config_from_hf(_hf_config(first_k_dense_replace=2).to_dict())
    assert (dense.family, dense.n_experts, dense.router_score) == ("deepseek_v3_dense", 0, "softmax")
    base = _hf_config().to_dict()
    for key, value in (("q_lora_rank", None), ("scoring_func", "softmax"), ("topk_method", "greedy")):
        with pytest.raises(ConfigError, match=f"{key}={value!r}"):
            hf_config.config_from_hf({**base, key: value})
    for preset in ("tiny-deepseek-v3", "deepseek-v3", "kimi-k2"):
        cfg = get_config(preset)
        assert hf_config.config_from_hf(hf_config.config_to_hf(cfg)) == cfg
    with pytest.raises(ConfigError, match="dense_layers=.1.: transformers' deepseek_v3 has its dense"):
        hf_config.config_to_hf(get_config("tiny-deepseek-v3").replace(dense_layers=[1]))
