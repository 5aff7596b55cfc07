"""Qwen3 (per-head q/k RMSNorm before rotary, explicit head_dim), OLMo 2 (norms after each branch, q/k
RMSNorm over the whole projection) and Phi-3 (fused qkv_proj and gate_up_proj, a sliding window, here
with grouped-query attention and partial rotary) from transformers: a tiny random model of each (no
download, every weight perturbed: the norm weights away from 1) converts with logits equal to
transformers' (float32, unsharded and on 2x2), `meshlm generate --temperature 0` prints transformers'
greedy text on 1x1 and 1x2, and the export loads back with equal logits. The q/k norm applied after
rotary in code both runs share is invisible to verify, and so is a fused tensor split in the wrong
order (k and v are the same size): only this comparison sees them (shown)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import haiku as hk  # noqa: E402
from hf_harness import Case, Comparison, GreedyText, drift, family_fixture  # noqa: E402
from hf_helpers import ROPE, RTOL, TINY  # noqa: E402

from meshlm.errors import ConfigError  # noqa: E402
from meshlm.io import hf_config, hf_weights  # noqa: E402
from meshlm.model import attention  # noqa: E402
from meshlm.model.config import get_config  # noqa: E402

SMALL = dict(**TINY, num_hidden_layers=2, intermediate_size=64)
family = family_fixture(
    [
        Case(
            "qwen3",
            "Qwen3ForCausalLM",
            # head_dim not hidden_size / heads (Qwen3-32B: 128 x 64 heads on 5120)
            lambda: transformers.Qwen3Config(head_dim=16, rope_parameters=ROPE, **SMALL),
        ),
        Case(
            "olmo2",
            "Olmo2ForCausalLM",
            lambda: transformers.Olmo2Config(rope_parameters=ROPE, pad_token_id=0, **SMALL),
        ),
        # A window of 6 (the generation runs past it), 2 KV heads (the fused q/k/v rows: 16 + 8 + 8),
        # half of each head rotated (Phi-4-mini's partial rotary).
        Case(
            "phi3",
            "Phi3ForCausalLM",
            lambda: transformers.Phi3Config(
                sliding_window=6,
                rope_parameters={**ROPE, "partial_rotary_factor": 0.5},
                pad_token_id=0,
                **SMALL,
            ),
        ),
    ]
)  # every parameter perturbed, the norm weights by 0.3 (far from 1, unequal across a head's rotary pairs)


class TestTransformers(Comparison, GreedyText):
    """Logits unsharded and on 2x2, the export, greedy text on 1x1 and 1x2 (tests/hf_harness.py)."""


@pytest.mark.parametrize("family", ["qwen3"], indirect=True)
def test_a_bug_common_to_both_runs_fails_the_transformers_comparison(family, monkeypatch):
    """Qwen3's q/k norm after rotary, in code both verify's runs share: equal at weights 1, not at
    transformers' perturbed ones."""
    monkeypatch.setattr(attention, "norm_then_rotary", lambda x, norm, rotate: norm(rotate(x)))
    assert drift(family) > 100 * RTOL


def _swapped(layer: dict, a: str, b: str) -> dict:
    """The tensor map with ``a`` and ``b`` in each other's places (so in each other's fused rows)."""
    order = [{a: b, b: a}.get(k, k) for k in layer]
    return {k: layer[k] for k in order}


@pytest.mark.parametrize("family", ["phi3"], indirect=True)
@pytest.mark.parametrize("a, b", [("attn/wk", "attn/wv"), ("mlp/w_gate", "mlp/w_up")])
def test_fused_rows_split_in_the_wrong_order_fail_the_transformers_comparison(family, a, b, monkeypatch):
    """k and v (gate and up) have the same shape: taking each other's rows of qkv_proj (gate_up_proj)
    converts without an error, and both runs would share it; transformers' logits tell."""
    from dataclasses import replace

    from meshlm.model.families import FAMILIES

    phi3 = FAMILIES["phi3"]
    monkeypatch.setitem(
        FAMILIES, "phi3", replace(phi3, hf=replace(phi3.hf, layer=_swapped(phi3.hf.layer, a, b)))
    )
    assert drift(family) > 100 * RTOL


@pytest.mark.parametrize("family", ["phi3"], indirect=True)
def test_fused_tensor_of_another_config_is_one_line(family, tmp_path):
    """config.json saying 4 KV heads where qkv_proj holds 2 (rows 32 + 16 + 16): the split sizes come
    from the config, so the fused tensor's shape is refused, naming it, its slices and their sum."""
    import json
    import shutil

    from meshlm.errors import CheckpointError

    shutil.copytree(family["hf"], tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 4}))
    with pytest.raises(
        CheckpointError, match=r"qkv_proj.weight has shape \(64, 32\) .* \(96, 32\) \(32 \+ 32 \+ 32 rows"
    ):
        hf_weights.load_hf(tmp_path)


@pytest.mark.parametrize(
    "changes, field, message",
    [
        (
            {"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}},
            "rope_scaling",
            "LongRoPE",
        ),
        ({"rope_parameters": {"rope_type": "su"}}, "rope_parameters", "LongRoPE"),
        (
            {"rope_parameters": {"rope_type": "llama3", "factor": 8.0}},
            "rope_parameters",
            "'default' or 'longrope'",
        ),
        ({"partial_rotary_factor": 0.2}, "partial_rotary_factor", "rotates an even number"),
        ({"resid_pdrop": 0.1}, "resid_pdrop", "dropout"),
        ({"hidden_act": "gelu"}, "hidden_act", "silu"),
    ],
)
def test_unsupported_phi3_config(changes, field, message):
    base = hf_config.config_to_hf(get_config("tiny-phi3"))
    del base["rope_parameters"]["partial_rotary_factor"], base["partial_rotary_factor"]
    with pytest.raises(ConfigError, match=f"(?s){field}.*{message}"):
        hf_config.config_from_hf({**base, **changes})


def test_phi3_config_fields():
    """Phi-3-mini-4k's window and full rotary; a top-level partial_rotary_factor (Phi-4-mini's place) is
    read, one in the rope dict wins (Phi3Config's precedence); no window when null."""
    base = hf_config.config_to_hf(get_config("phi3-mini"))
    assert base["sliding_window"] == 2047 and base["rope_parameters"]["partial_rotary_factor"] == 1.0
    del base["rope_parameters"]["partial_rotary_factor"]
    assert hf_config.config_from_hf({**base, "partial_rotary_factor": 0.75}).rotary_dim == 72
    rope = {**base["rope_parameters"], "partial_rotary_factor": 0.5}
    assert (
        hf_config.config_from_hf({**base, "partial_rotary_factor": 0.75, "rope_parameters": rope}).rotary_dim
        == 48
    )
    assert hf_config.config_from_hf({**base, "sliding_window": None}).sliding_window == 0


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_unsupported_qwen3_config(changes, field):
    base = hf_config.config_to_hf(get_config("tiny-qwen3"))
    with pytest.raises(ConfigError, match=field):
        hf_config.config_from_hf({**base, **changes})


def test_qwen3_head_dim_default_is_transformers():
    """A Qwen3 config.json without head_dim means 128 (Qwen3Config's default), not hidden / heads."""
    base = hf_config.config_to_hf(get_config("qwen3-8b"))
    del base["head_dim"]
    assert hf_config.config_from_hf({**base, "hidden_size": 2048}).dim_per_head == 128


def test_unsupported_olmo2_config():
    base = hf_config.config_to_hf(get_config("tiny-olmo2"))
    with pytest.raises(ConfigError, match="attention_bias"):
        hf_config.config_from_hf({**base, "attention_bias": True})


def test_collective_minimum_counts_the_qk_norms():
    """Qwen3: the replicated norm weights' gradients (q's, k's per layer); OLMo 2: the gathered mean
    squares (2 forward, 2 backward per layer), and with replicated KV heads the k norm's gradient."""
    from meshlm.perf.collectives import theoretical_collectives

    qwen3, olmo2 = get_config("tiny-qwen3"), get_config("tiny-olmo2")  # 2 layers, 2 KV heads
    assert theoretical_collectives(qwen3, 1, 2)["qk_norm_grads"] == 4
    assert theoretical_collectives(qwen3, 1, 1)["total"] == 0
    two, four = theoretical_collectives(olmo2, 1, 2), theoretical_collectives(olmo2, 1, 4)
    assert (two["qk_norm_stats"], two["qk_norm_grads"], four["qk_norm_grads"]) == (8, 0, 2)
    assert theoretical_collectives(olmo2.replace(remat="full"), 1, 2)["qk_norm_stats"] == 12


@pytest.mark.parametrize(
    "preset", ["tiny-qwen3", "qwen3-8b", "qwen3-32b", "tiny-olmo2", "olmo2-7b", "tiny-phi3", "phi3-mini"]
)
def test_preset_config_round_trip(preset):
    cfg = get_config(preset)
    assert hf_config.config_from_hf(hf_config.config_to_hf(cfg)) == cfg


def test_olmo2_norm_is_transformers_bit_for_bit_in_bfloat16():
    """Olmo2RMSNorm multiplies by its weight in float32, then casts: so does ours ("rms_product_first");
    Llama's order (cast, then multiply) differs in bfloat16."""
    import jax.numpy as jnp
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    from meshlm.model.layers import RMSNorm, RMSNormProductFirst

    torch.manual_seed(0)
    x, w = torch.randn(16, 64).to(torch.bfloat16), (1 + 0.3 * torch.randn(64)).to(torch.bfloat16)
    theirs = Olmo2RMSNorm(64, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        theirs.weight.copy_(w)
        want = theirs(x).float().numpy()
    params = {"n": {"scale": jnp.asarray(w.float().numpy(), jnp.bfloat16)}}
    xj = jnp.asarray(x.float().numpy(), jnp.bfloat16)

    def ours(cls):
        out = hk.transform(lambda v: cls(eps=1e-6, name="n")(v)).apply(params, None, xj)
        return np.asarray(out.astype(jnp.float32))

    from meshlm.model.families import olmo2
    from meshlm.model.transformer import NORMS

    assert NORMS[olmo2.FAMILY.norm] is RMSNormProductFirst  # every OLMo 2 norm, the final one too
    assert np.array_equal(ours(RMSNormProductFirst), want)
    assert not np.array_equal(ours(RMSNorm), want)
