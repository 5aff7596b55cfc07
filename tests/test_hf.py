"""Hugging Face conversion: our logits equal transformers' for imported GPT-J / Llama models,
unsharded and on meshes; exports load in transformers with the same logits; bad configs fail loudly."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
from helpers import run_cli, sharded_logits  # noqa: E402
from hf_helpers import hf_logits as _hf_logits  # noqa: E402
from hf_helpers import our_logits as _our_logits  # noqa: E402

from meshlm.errors import CheckpointError, ConfigError  # noqa: E402
from meshlm.io import hf_config, hf_weights  # noqa: E402
from meshlm.model.config import get_config  # noqa: E402
from meshlm.model.params import unflatten  # noqa: E402
from meshlm.parallel.mesh import make_mesh  # noqa: E402

ATOL = 1e-4
VOCAB = 64
SMALL = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0)  # token ids must fit the vocabulary
HF_CONFIGS = {
    "gptj": lambda: transformers.GPTJConfig(
        n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=32, **SMALL
    ),
    "llama": lambda: transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,  # grouped-query attention
        intermediate_size=128,
        max_position_embeddings=32,
        rope_theta=500.0,  # not the default, so a dropped theta shows
        **SMALL,
    ),
    "llama-tied-hd": lambda: transformers.LlamaConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,  # not hidden_size / heads
        intermediate_size=64,
        max_position_embeddings=32,
        tie_word_embeddings=True,
        **SMALL,
    ),
}
MODEL_CLASSES = {"gptj": "GPTJForCausalLM", "llama": "LlamaForCausalLM", "llama-tied-hd": "LlamaForCausalLM"}


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, VOCAB, (4, 16))


@pytest.fixture(scope="module", params=list(HF_CONFIGS))
def hf_model(request, tmp_path_factory, tokens):
    """(name, saved directory, transformers logits) of a tiny random model.

    Every parameter is perturbed (biases and norm weights too, which start at 0 / 1) so that a
    wrong mapping of any one tensor shows in the logits.
    """
    torch.manual_seed(0)
    model = getattr(transformers, MODEL_CLASSES[request.param])(HF_CONFIGS[request.param]()).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path, safe_serialization=True)
    return request.param, path, _hf_logits(model, tokens)


def test_import_matches_transformers(hf_model, tokens):
    _, path, want = hf_model
    cfg, flat = hf_weights.load_hf(path)
    np.testing.assert_allclose(_our_logits(cfg, flat, tokens), want, atol=ATOL, rtol=0)


# slow: the sharded logits (scale); the sharded model equals the unsharded one by the quick proofs, the
# unsharded one equals transformers quick above
@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", [(2, 2), (1, 4)])
def test_import_matches_transformers_sharded(hf_model, tokens, mesh_shape):
    _, path, want = hf_model
    cfg, flat = hf_weights.load_hf(path)
    got = sharded_logits(cfg, unflatten(flat), tokens, mesh_shape)  # each model shard's copy
    assert got.shape == (mesh_shape[1], *want.shape)
    for copy in got:
        np.testing.assert_allclose(copy, want, atol=ATOL, rtol=0)


def test_export_loads_in_transformers(hf_model, tokens, tmp_path):
    name, path, want = hf_model
    cfg, flat = hf_weights.load_hf(path)
    hf_weights.save_hf(cfg, flat, tmp_path)
    with open(tmp_path / hf_weights.WEIGHTS_FILE, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert ("lm_head.weight" in header) == (name != "llama-tied-hd")  # tied: no lm_head written
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    np.testing.assert_allclose(_hf_logits(model, tokens), want, atol=ATOL, rtol=0)
    assert hf_weights.load_hf(tmp_path)[0] == cfg


def test_sharded_index_and_bfloat16(tmp_path, tokens):
    """Several safetensors files behind an index; bfloat16 weights arrive as float32."""
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(HF_CONFIGS["llama"]()).to(torch.bfloat16)
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB")
    assert (tmp_path / hf_weights.INDEX_FILE).is_file() and len(list(tmp_path.glob("*.safetensors"))) > 1
    cfg, flat = hf_weights.load_hf(tmp_path)
    assert all(v.dtype == np.float32 for v in flat.values())
    want = model.state_dict()["model.layers.1.mlp.down_proj.weight"].float().numpy()
    np.testing.assert_array_equal(flat["layers/mlp/w_down"][1], want.T)


@pytest.mark.parametrize("hf_model", ["llama"], indirect=True)  # the command is the same for every family
def test_cli_round_trip(hf_model, tokens, tmp_path, capsys):
    _, path, want = hf_model
    ckpt, out = tmp_path / "ckpt", tmp_path / "hf"
    assert run_cli("convert", "--from-hf", str(path), "--out", str(ckpt), "--mesh", "2x2") == 0
    assert run_cli("convert", "--to-hf", str(ckpt), "--out", str(out), "--mesh", "1x4") == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and "parameters" in lines[0] and str(ckpt) in lines[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    np.testing.assert_allclose(_hf_logits(model, tokens), want, atol=ATOL, rtol=0)
    assert run_cli("convert", "--to-hf", str(ckpt), "--out", str(out)) == 2
    assert "not an empty directory" in capsys.readouterr().err


LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
LLAMA3["original_max_position_embeddings"] = 16


def _llama_dict(**changes) -> dict:
    return {**hf_config.config_to_hf(get_config("tiny-llama")), **changes}


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling.rope_type"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 5e5}}, "rope_parameters.rope_type"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5}}, "no original_max_position"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, "rope_parameters of rope_type"),
        ({"rope_scaling": {"rope_type": "llama3", **LLAMA3, "beta": 1.0}}, "rope_scaling keys"),
        ({"rope_scaling": {"rope_type": "llama3", **LLAMA3, "factor": -1.0}}, "factor"),
        ({"model_type": "qwen2", "architectures": None, "use_sliding_window": True}, "use_sliding_window"),
        ({"model_type": "qwen2", "architectures": None, "layer_types": ["sliding_attention"]}, "layer_types"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_dropout": 0.1}, "attention_dropout"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"model_type": "gpt2"}, "model_type"),
        ({"architectures": ["LlamaForSequenceClassification"]}, "architectures"),
    ],
)
def test_unsupported_llama_config(changes, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        hf_config.config_from_hf(_llama_dict(**changes))


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"activation_function": "relu"}, "activation_function"),
        ({"tie_word_embeddings": True}, "tie_word_embeddings"),
        ({"rotary_dim": None}, "rotary_dim"),
        ({"resid_pdrop": 0.1}, "resid_pdrop"),
    ],
)
def test_unsupported_gptj_config(changes, field):
    with pytest.raises(ConfigError, match=field):
        hf_config.config_from_hf({**hf_config.config_to_hf(get_config("tiny-gptj")), **changes})


@pytest.mark.parametrize(
    "preset", ["tiny-gptj", "tiny-llama", "gptj-6b", "llama2-7b", "cpu", "llama3.1-70b", "qwen2.5-7b"]
)
def test_config_round_trip(preset):
    cfg = get_config(preset)
    assert hf_config.config_from_hf(hf_config.config_to_hf(cfg)) == cfg


def test_unexportable_configs():
    with pytest.raises(ConfigError, match="family 'ff'"):
        hf_config.config_to_hf(get_config("tiny"))
    with pytest.raises(ConfigError, match="rotary_style"):
        hf_config.config_to_hf(get_config("tiny-llama").replace(rotary_style="interleaved"))


@pytest.mark.parametrize("hf_model", ["gptj"], indirect=True)
def test_missing_and_unexpected_tensors(hf_model, tmp_path):
    from safetensors.numpy import load_file, save_file

    _, path, _ = hf_model
    (tmp_path / hf_weights.CONFIG_FILE).write_text((path / hf_weights.CONFIG_FILE).read_text())
    tensors = load_file(path / hf_weights.WEIGHTS_FILE)
    tensors["transformer.h.0.attn.q_proj.bias"] = tensors.pop("transformer.h.1.mlp.fc_in.bias")
    save_file(tensors, tmp_path / hf_weights.WEIGHTS_FILE)
    with pytest.raises(CheckpointError, match=r"missing \['transformer.h.1.mlp.fc_in.bias'\].*q_proj.bias"):
        hf_weights.load_hf(tmp_path)


# slow: GPT-2's vocabulary converted and run on mp 2 and 4 (its cost); the padded vocabulary's proofs:
# tests/test_vocab_padding.py, quick
@pytest.mark.slow
def test_gpt2_vocabulary_converts_and_runs_on_mp_2_and_4(tmp_path, tokens, capsys):
    """Vocab 50257 (prime to every mp > 1): imported padded to 50304 rows (zeros), runs sharded with
    transformers' logits over the real vocabulary, and exports with the padding stripped."""
    from safetensors.numpy import load_file

    from meshlm.io.model_io import load_model

    hf_cfg = transformers.LlamaConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
        vocab_size=50257,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hf_cfg).eval()
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    ids = tokens.copy()
    ids[:, -1] = 50256  # the last real id
    want = _hf_logits(model, ids)
    ckpt = tmp_path / "ckpt"
    assert run_cli("convert", "--from-hf", str(tmp_path / "hf"), "--out", str(ckpt), "--mesh", "1x2") == 0
    for mesh_shape in [(1, 2), (2, 2), (1, 4)]:
        cfg, params, _ = load_model(ckpt, make_mesh(*mesh_shape))
        assert (cfg.vocab_size, cfg.padded_vocab) == (50257, 50304)
        assert params["embed"]["embeddings"].shape == (50304, 32)
        assert not np.any(np.asarray(params["head"]["w"])[:, 50257:])  # the padding is zeros
        host = jax.tree.map(np.asarray, params)
        for copy in sharded_logits(cfg, host, ids, mesh_shape):
            np.testing.assert_allclose(copy, want, atol=ATOL, rtol=0)
    assert run_cli("convert", "--to-hf", str(ckpt), "--out", str(tmp_path / "back"), "--mesh", "1x4") == 0
    tensors = load_file(tmp_path / "back" / hf_weights.WEIGHTS_FILE)
    assert tensors["model.embed_tokens.weight"].shape == (50257, 32)
    assert tensors["lm_head.weight"].shape == (50257, 32)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    np.testing.assert_allclose(_hf_logits(back, ids), want, atol=ATOL, rtol=0)
