"""Llama 4 (text) from transformers: a tiny random model (no download; every weight perturbed) with chunks
of 4 under a 16-token text on the rotated layers (L2-normed q/k, Meta's complex-pair rotary), a NoPE
fourth layer with the attention temperature (floor 4: it steps inside the text), and the MoE on every
second layer (top-1, its sigmoid on the token before the expert, a shared expert; experts of 16 units,
dense layers of 48) converts with logits equal to transformers' (float32, unsharded and on 2x2);
`meshlm generate --temperature 0` prints transformers' greedy text on 1x1 and 1x2; the export loads
back with equal logits. The L2 norm and the temperature each fail the comparison when dropped."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers import run_cli, sharded_logits  # noqa: E402
from hf_helpers import (  # noqa: E402
    CORPUS,
    NEW,
    PROMPT,
    RTOL,
    VOCAB,
    bpe_tokenizer,
    export_round_trip,
    hf_logits,
    our_logits,
    perturbed_model,
    random_tokens,
    rel,
)

from meshlm.errors import ConfigError  # noqa: E402
from meshlm.io import hf_config, hf_weights  # noqa: E402
from meshlm.model.config import get_config  # noqa: E402
from meshlm.model.params import unflatten  # noqa: E402

HF = dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, intermediate_size=16, intermediate_size_mlp=48,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=1,
    interleave_moe_layer_step=2, attention_chunk_size=4, floor_scale=4, attn_scale=0.1,
    max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
    router_aux_loss_coef=0.02, bos_token_id=0, eos_token_id=0, pad_token_id=0,
)  # fmt: skip


@pytest.fixture(scope="module")
def tokens():
    return random_tokens()


@pytest.fixture(scope="module")
def llama4(tokens, tmp_path_factory):
    """{hf (directory), ckpt (converted, 1x1), model, logits, text (greedy)}."""
    torch.manual_seed(0)
    model = perturbed_model(transformers.Llama4ForCausalLM, transformers.Llama4TextConfig(**HF))
    root = tmp_path_factory.mktemp("llama4")
    tokenizer = bpe_tokenizer(CORPUS, VOCAB)
    model.save_pretrained(root / "hf")
    tokenizer.save_pretrained(root / "hf")
    argv = ("convert", "--from-hf", str(root / "hf"), "--out", str(root / "ckpt"), "--mesh", "1x1")
    assert run_cli(*argv) == 0
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert len(set(out[0, ids.shape[1] :].tolist())) > 3
    return dict(hf=root / "hf", ckpt=root / "ckpt", model=model, text=text, logits=hf_logits(model, tokens))


def test_logits_equal_transformers(llama4, tokens):
    cfg, flat = hf_weights.load_hf(llama4["hf"])
    want = dict(family="llama4", dense_layers=(0, 2), d_ff=48, moe_d_ff=16, attn_chunk=4, global_every=4)
    want.update(global_nope=True, qk_l2_norm=True, attn_floor_scale=4.0, weights_on_input=True)
    assert {k: getattr(cfg, k) for k in want} == want
    assert rel(our_logits(cfg, flat, tokens), llama4["logits"]) <= RTOL
    for copy in sharded_logits(cfg, unflatten(flat), tokens):
        assert rel(copy, llama4["logits"]) <= RTOL
    for dropped in (dict(qk_l2_norm=False), dict(attn_floor_scale=0.0, attn_temp_scale=0.0)):
        assert rel(our_logits(cfg.replace(**dropped), flat, tokens), llama4["logits"]) > 100 * RTOL


@pytest.mark.parametrize("mesh", ["1x1", "1x2"])
def test_generate_prints_transformers_text(llama4, mesh, capsys):
    capsys.readouterr()
    argv = ["generate", "--checkpoint", str(llama4["ckpt"]), "--mesh", mesh, "--temperature", "0"]
    assert run_cli(*argv, "--prompt", PROMPT, "--max-new-tokens", str(NEW)) == 0
    assert capsys.readouterr().out == PROMPT + llama4["text"] + "\n"


def test_export_loads_in_transformers(llama4, tokens, tmp_path):
    name, err, same = export_round_trip(llama4["hf"], tmp_path, tokens, llama4["logits"])
    assert (name, same) == ("Llama4ForCausalLM", True) and err <= RTOL


def test_config_refusals_and_round_trip():
    cfg = get_config("tiny-llama4")
    assert hf_config.config_from_hf(hf_config.config_to_hf(cfg)) == cfg
    base = hf_config.config_to_hf(cfg)
    with pytest.raises(ConfigError, match="router_jitter_noise"):
        hf_config.config_from_hf({**base, "router_jitter_noise": 0.1})
    with pytest.raises(ConfigError, match="experts_per_token=1"):
        hf_config.config_from_hf({**base, "num_experts_per_tok": 2})
