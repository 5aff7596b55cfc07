"""gpt-oss from transformers: a tiny random model (no download; every weight perturbed) with sinks, windows
of 4 on alternate layers under a 16-token text, YaRN on both kinds of layer, q/k/v/o biases and a MoE of
4 experts (router and expert biases, the clamped SwiGLU with a limit that bites) converts with logits
equal to transformers' (float32, unsharded and on 2x2); `meshlm generate --temperature 0` prints
transformers' greedy text on 1x1, 1x2 and with ``--ep 2``; the export loads back with equal logits.
MXFP4: our dequantisation equals transformers' ``convert_moe_packed_tensors`` on random blocks, and a
checkpoint holding its experts as ``*_blocks`` / ``*_scales`` converts to the model of their values."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_harness import Case, Comparison, GreedyText, drift, family_fixture, kv_slots  # noqa: E402
from hf_helpers import VOCAB  # noqa: E402

from meshlm.errors import ConfigError  # noqa: E402
from meshlm.io import hf_config, hf_weights, mxfp4  # noqa: E402
from meshlm.model.config import get_config  # noqa: E402

YARN = dict(rope_type="yarn", rope_theta=1e4, factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
            original_max_position_embeddings=8)  # fmt: skip
HF = dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, intermediate_size=16, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
    max_position_embeddings=64, rope_parameters=YARN, swiglu_limit=1.0, router_aux_loss_coef=0.02,
    bos_token_id=0, eos_token_id=0, pad_token_id=0,
)  # fmt: skip


family = family_fixture(
    [
        Case(
            "gpt_oss",
            "GptOssForCausalLM",
            lambda: transformers.GptOssConfig(**HF),
            reads=dict(n_experts=4, moe_d_ff=16, global_every=2, sliding_window=4, attn_sinks=True)
            | dict(router_bias=True, expert_bias=True, swiglu_alpha=1.702, swiglu_limit=1.0),
            sharded=("--mesh", "2x1", "--ep", "2"),  # the experts over ep; mp's split: the 2x2 logits
            generated=kv_slots(4, 12),  # the windowed layers hold their window of 4, the full ones more
        )
    ]
)


class TestTransformers(Comparison, GreedyText):
    """Logits unsharded and on 2x2, the export, greedy text on 1x1 and 2x1 --ep 2 past several windows
    (tests/hf_harness.py)."""


def test_the_clamp_bites(family):
    """With a limit none of these activations reach, the logits differ from transformers'."""
    assert drift(family, swiglu_limit=1e9) > 1e-3


def _random_mxfp4(shape, seed=0):
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (*shape, 16), dtype=np.uint8)
    return blocks, rng.integers(110, 135, shape, dtype=np.uint8)  # 2^-17 .. 2^7: finite, not subnormal


def test_mxfp4_is_transformers_dequantisation():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _random_mxfp4((3, 6, 2))  # [E, R, G]: every code, both nibbles, many scales
    ours = mxfp4.dequantise(blocks, scales)
    for dtype in (torch.float32, torch.bfloat16):
        theirs = convert_moe_packed_tensors(torch.tensor(blocks), torch.tensor(scales), dtype=dtype)
        np.testing.assert_array_equal(ours, theirs.float().numpy())
    assert ours.shape == (3, 64, 6) and len(np.unique(np.abs(ours))) > 50  # 7 nonzero codes x 19 scales


def test_mxfp4_checkpoint_converts_to_its_values(family, tmp_path):
    """The experts as MXFP4 blocks and scales (as the released checkpoints ship them): the conversion holds
    exactly the dequantised values, and the rest of the model is the dense checkpoint's."""
    import shutil

    from safetensors.numpy import load_file, save_file

    tensors = load_file(family["hf"] / "model.safetensors")
    values = {}
    for i in range(HF["num_hidden_layers"]):
        at = f"model.layers.{i}.mlp.experts.gate_up_proj"  # [E, D, 2I]; blocks [E, 2I, D / 32, 16]
        del tensors[at]
        blocks, scales = _random_mxfp4((4, 2 * HF["intermediate_size"], HF["hidden_size"] // 32), seed=i)
        tensors[at + "_blocks"], tensors[at + "_scales"] = blocks, scales
        values[at] = mxfp4.dequantise(blocks, scales)
    (tmp_path / "q").mkdir()
    shutil.copy(family["hf"] / "config.json", tmp_path / "q")
    save_file(tensors, tmp_path / "q" / "model.safetensors", metadata={"format": "pt"})
    _, dense = hf_weights.load_hf(family["hf"])
    cfg, flat = hf_weights.load_hf(tmp_path / "q")
    gate_up = values["model.layers.1.mlp.experts.gate_up_proj"]  # [E, D, 2I], gate at the even columns
    np.testing.assert_array_equal(flat["layers/moe/experts/w_gate"][1], gate_up[..., 0::2])
    np.testing.assert_array_equal(flat["layers/moe/experts/w_up"][1], gate_up[..., 1::2])
    for path in ("layers/attn/sinks", "layers/moe/experts/w_down", "layers/moe/experts/b_gate", "head/w"):
        np.testing.assert_array_equal(flat[path], dense[path])


@pytest.mark.parametrize(
    "change, names",
    [({"attention_bias": False}, "attention_bias"), ({"hidden_act": "gelu"}, "hidden_act")],
)
def test_unsupported_fields_are_named(change, names):
    base = hf_config.config_to_hf(get_config("tiny-gpt-oss"))
    with pytest.raises(ConfigError, match=names):
        hf_config.config_from_hf({**base, **change})


def test_presets_round_trip_and_export_refusals():
    for preset in ("tiny-gpt-oss", "gpt-oss-20b", "gpt-oss-120b"):
        cfg = get_config(preset)
        assert hf_config.config_from_hf(hf_config.config_to_hf(cfg)) == cfg
    with pytest.raises(ConfigError, match="swiglu_limit=0.0"):
        hf_config.config_to_hf(get_config("tiny-gpt-oss").replace(swiglu_limit=0.0))
