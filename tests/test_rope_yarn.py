"""YaRN (``model.rope.YarnScaling``) against transformers' own ``_compute_yarn_parameters``: the same
float32 frequencies bit for bit and the same attention factor (float64), for DeepSeek-V3's parameters
(mscale and mscale_all_dim), gpt-oss's (truncate false), Qwen's (factor only) and a null factor (the
context ratio); its config.json round trip; and its bad values refused in one line. Llama 3's scaling
against ``_compute_llama3_parameters`` the same way: Llama 3.1's ramp, and Llama 4 Scout's step (its two
frequency factors equal: no ramp)."""

import math

import numpy as np
import pytest

from meshlm.errors import ConfigError
from meshlm.model.families.hf_fields import rope, rope_fields
from meshlm.model.rope import YarnScaling, attention_scale, inv_freq, scaling_of

CASES = {  # (rope_parameters, head_dim, max_position_embeddings)
    "deepseek-v3": (
        dict(
            factor=40,
            original_max_position_embeddings=4096,
            beta_fast=32,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
        64,
        163840,
    ),
    "mscale-ratio": (
        dict(factor=8, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=0.5),
        8,
        512,
    ),
    "gpt-oss": (
        dict(factor=32, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1, truncate=False),
        64,
        131072,
    ),
    "qwen": (dict(factor=4, original_max_position_embeddings=32768), 128, 131072),
    "null-factor": (dict(factor=None, original_max_position_embeddings=4096), 64, 16384),
}


def _transformers(params, head_dim, max_pos, theta=10000.0):
    from transformers import PretrainedConfig
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    cfg = PretrainedConfig()
    cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim = head_dim * 4, 4, head_dim
    cfg.max_position_embeddings = max_pos
    cfg.rope_parameters = {"rope_type": "yarn", "rope_theta": theta, **params}
    freqs, factor = _compute_yarn_parameters(cfg)
    return freqs.numpy(), float(factor)


LLAMA3 = {  # llama3 rope_parameters at rope_theta 5e5, head_dim 128
    "llama3.1": dict(factor=8, low_freq_factor=1, high_freq_factor=4, original_max_position_embeddings=8192),
    "llama4-scout": dict(
        factor=16, low_freq_factor=1, high_freq_factor=1, original_max_position_embeddings=8192
    ),
}


@pytest.mark.parametrize("case", sorted(LLAMA3))
def test_llama3_scaling_matches_transformers(case):
    from transformers import PretrainedConfig
    from transformers.modeling_rope_utils import _compute_llama3_parameters

    hf = {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **LLAMA3[case]}}
    cfg = PretrainedConfig()
    cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.max_position_embeddings = 512, 4, 128, 8192
    cfg.rope_parameters = hf["rope_parameters"]
    want = _compute_llama3_parameters(cfg)[0].numpy()
    theta, scaling = rope(hf)
    got, plain = inv_freq(128, theta, scaling), inv_freq(128, theta)
    assert np.array_equal(got.astype(np.float32), want)
    kept, divided = np.isclose(got, plain, rtol=1e-6), np.isclose(got * scaling.factor, plain, rtol=1e-6)
    assert kept.any() and divided.any() and (kept | divided).all() == (case == "llama4-scout")  # a step


@pytest.mark.parametrize("case", sorted(CASES))
def test_yarn_matches_transformers(case):
    params, head_dim, max_pos = CASES[case]
    want_freq, want_factor = _transformers(params, head_dim, max_pos)
    hf = {
        "max_position_embeddings": max_pos,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, **params},
    }
    theta, scaling = rope(hf)
    got = inv_freq(head_dim, theta, scaling)
    assert got.dtype == np.float64 and np.array_equal(got.astype(np.float32), want_freq)
    assert abs(attention_scale(scaling) - want_factor) <= 1e-15
    assert not np.array_equal(got, inv_freq(head_dim, theta))  # the blend changes the frequencies


def test_deepseek_score_mscale_is_transformers():
    """DeepSeek's softmax scale: qk_head_dim^-0.5 times yarn_get_mscale(factor, mscale_all_dim)^2."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import yarn_apply_mscale

    params = {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707}
    want = yarn_apply_mscale(params, 192**-0.5)
    got = (
        192**-0.5
        * YarnScaling(factor=40, original_max_position_embeddings=4096, mscale_all_dim=0.707).score_mscale()
    )
    assert abs(got - want) <= 1e-15 * want and got != 192**-0.5
    assert YarnScaling(factor=40, original_max_position_embeddings=4096).score_mscale() == 1.0


def test_yarn_round_trips_and_refuses():
    scaling = YarnScaling(factor=8, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=0.5)
    saved = {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 64,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
    }
    assert scaling_of(saved) == scaling and scaling_of(scaling) is scaling

    class Cfg:
        rope_theta, rope_scaling = 1e4, scaling

    fields = rope_fields(Cfg)
    assert fields["rope_type"] == "yarn" and "attention_factor" not in fields  # 0: absent, as HF's null
    assert rope({"max_position_embeddings": 512, "rope_parameters": fields}) == (1e4, scaling)
    assert math.isclose(scaling.attention_scale(), (0.1 * math.log(8) + 1) / (0.05 * math.log(8) + 1))
    with pytest.raises(ConfigError, match=r"rope_scaling.beta_fast must be a number > 0"):
        YarnScaling(factor=8, original_max_position_embeddings=64, beta_fast=0)
    with pytest.raises(ConfigError, match="has no original_max_position_embeddings"):
        rope({"rope_parameters": {"rope_type": "yarn", "factor": 4}})
    with pytest.raises(ConfigError, match=r"keys.*'bogus'"):
        rope({"rope_parameters": {"rope_type": "yarn", "factor": 4, "bogus": 1}})
