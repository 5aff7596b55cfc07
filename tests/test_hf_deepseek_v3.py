"""DeepSeek-V3 from transformers 5: a tiny random all-dense ``DeepseekV3ForCausalLM`` (multi-head latent
attention with low-rank queries, a shared rotary key, v_head_dim != the q/k head, interleaved rotary,
YaRN with mscale != mscale_all_dim so both its factors matter) converts with logits equal to
transformers' (float32, unsharded and on 2x2), `meshlm generate --temperature 0` prints transformers'
greedy text on 1x1 and 1x2 (the prompt and text longer than a block), and the export loads back with
equal logits. A config.json with MoE layers (DeepSeek's sigmoid router: not built) is one line."""

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
from meshlm.model import mla  # noqa: E402
from meshlm.model.params import unflatten  # noqa: E402

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


@pytest.fixture(scope="module")
def tokens():
    return random_tokens()


@pytest.fixture(scope="module")
def converted(tokens, tmp_path_factory):
    """{hf (directory), ckpt (converted, 1x1), model, logits, text (greedy)}; every weight perturbed."""
    torch.manual_seed(0)
    tokenizer = bpe_tokenizer(CORPUS, VOCAB)
    model = perturbed_model(transformers.DeepseekV3ForCausalLM, _hf_config())
    root = tmp_path_factory.mktemp("deepseek_v3")
    model.save_pretrained(root / "hf")
    tokenizer.save_pretrained(root / "hf")
    argv = ("convert", "--from-hf", str(root / "hf"), "--out", str(root / "ckpt"), "--mesh", "1x1")
    assert run_cli(*argv) == 0
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    assert len(set(out[0, ids.shape[1] :].tolist())) > 3
    text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    return dict(hf=root / "hf", ckpt=root / "ckpt", model=model, text=text, logits=hf_logits(model, tokens))


def test_logits_equal_transformers_and_a_shared_bug_does_not(converted, tokens, monkeypatch):
    cfg, flat = hf_weights.load_hf(converted["hf"])
    assert (cfg.family, cfg.mla, cfg.head_dim, cfg.rot_dim, cfg.v_head_dim) == (
        "deepseek_v3_dense",
        True,
        12,
        4,
        6,
    )
    assert rel(our_logits(cfg, flat, tokens), converted["logits"]) <= RTOL
    for copy in sharded_logits(cfg, unflatten(flat), tokens):  # 2x2
        assert rel(copy, converted["logits"]) <= RTOL
    # the YaRN attention factor on q only: both runs would share it, transformers' logits tell
    planted = lambda x, cos, sin, scale, style, query: mla.apply_rotary(
        x, cos * (scale if query else 1.0), sin * (scale if query else 1.0), x.shape[-1], style
    )
    monkeypatch.setattr(mla, "rotate_pair", planted)
    assert rel(our_logits(cfg, flat, tokens), converted["logits"]) > 100 * RTOL


@pytest.mark.parametrize("mesh", ["1x1", "1x2"])
def test_generate_prints_transformers_text(converted, mesh, capsys):
    capsys.readouterr()
    argv = ["generate", "--checkpoint", str(converted["ckpt"]), "--mesh", mesh, "--temperature", "0"]
    assert run_cli(*argv, "--prompt", PROMPT, "--max-new-tokens", str(NEW)) == 0
    assert capsys.readouterr().out == PROMPT + converted["text"] + "\n"


def test_export_loads_in_transformers(converted, tokens, tmp_path):
    name, err, same = export_round_trip(converted["hf"], tmp_path, tokens, converted["logits"])
    assert (name, same) == ("DeepseekV3ForCausalLM", True) and err <= RTOL


def test_moe_router_and_plain_queries_are_one_line():
    hf = _hf_config(first_k_dense_replace=1).to_dict()
    with pytest.raises(ConfigError, match=r"first_k_dense_replace=1 .* DeepSeek's MoE router .* not built"):
        hf_config.config_from_hf(hf)
    with pytest.raises(ConfigError, match=r"q_lora_rank=None"):
        hf_config.config_from_hf({**_hf_config().to_dict(), "q_lora_rank": None})
