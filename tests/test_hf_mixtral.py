"""Mixtral from transformers: a tiny random MixtralForCausalLM (no download; every weight perturbed, the
norm weights away from 1) converts with logits equal to transformers' (float32, unsharded and on 2x2),
from both weight layouts (per-expert tensors, as save_pretrained writes, and transformers 5's fused
``gate_up_proj`` / ``down_proj``); `meshlm generate --temperature 0` prints transformers' greedy text on
1x1, 1x2 and 2x1 with --ep 2; the export loads back with equal logits; the "hf" load-balancing loss is
transformers'."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import haiku as hk  # noqa: E402
from helpers import run_cli, sharded_logits  # noqa: E402
from hf_helpers import (  # noqa: E402  # noqa: E402
    CORPUS,
    NEW,
    PROMPT,
    RTOL,
    VOCAB,
    export_round_trip,
    hf_logits,
    our_logits,
    perturbed_model,  # noqa: E402
    random_tokens,
    rel,
    write_fused,
)

from meshlm.data.bpe import train_bpe  # noqa: E402
from meshlm.data.hf_tokenizer import EOD_TOKEN  # noqa: E402
from meshlm.errors import ConfigError  # noqa: E402
from meshlm.io import hf_config, hf_weights  # noqa: E402
from meshlm.model import moe  # noqa: E402
from meshlm.model.config import get_config  # noqa: E402
from meshlm.model.params import unflatten  # noqa: E402
from meshlm.model.transformer import local_logits_stats  # noqa: E402
from meshlm.parallel.context import Parallel  # noqa: E402


@pytest.fixture(scope="module")
def tokens():
    return random_tokens()


@pytest.fixture(scope="module")
def mixtral(tokens, tmp_path_factory):
    """{hf (directory), fused (the same weights under transformers' in-memory names), ckpt (converted,
    1x1), model, logits, text (greedy)}."""
    torch.manual_seed(0)
    hf_cfg = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, intermediate_size=32, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4}, bos_token_id=0, eos_token_id=0,
        router_aux_loss_coef=0.02,
    )  # fmt: skip
    model = perturbed_model(transformers.MixtralForCausalLM, hf_cfg)
    root = tmp_path_factory.mktemp("mixtral")
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=train_bpe(CORPUS, VOCAB).tok, eos_token=EOD_TOKEN
    )
    model.save_pretrained(root / "hf")
    tokenizer.save_pretrained(root / "hf")
    write_fused(model, root / "hf", root / "fused")
    assert (
        run_cli("convert", "--from-hf", str(root / "hf"), "--out", str(root / "ckpt"), "--mesh", "1x1") == 0
    )
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert len(set(out[0, ids.shape[1] :].tolist())) > 3
    return dict(hf=root / "hf", fused=root / "fused", ckpt=root / "ckpt", model=model, text=text,
                logits=hf_logits(model, tokens))  # fmt: skip


@pytest.mark.parametrize("layout", ["hf", "fused"])
def test_logits_equal_transformers(mixtral, tokens, layout):
    cfg, flat = hf_weights.load_hf(mixtral[layout])
    assert cfg.family == "mixtral" and cfg.n_experts == 4 and cfg.router_aux_loss_coef == 0.02
    assert rel(our_logits(cfg, flat, tokens), mixtral["logits"]) <= RTOL
    if layout == "hf":
        for copy in sharded_logits(cfg, unflatten(flat), tokens):
            assert rel(copy, mixtral["logits"]) <= RTOL


@pytest.mark.parametrize("mesh", [("1x1",), ("1x2",), ("2x1", "--ep", "2")], ids=["1x1", "1x2", "ep2"])
def test_generate_prints_transformers_text(mixtral, mesh, capsys):
    capsys.readouterr()
    argv = ["generate", "--checkpoint", str(mixtral["ckpt"]), "--mesh", *mesh, "--temperature", "0"]
    assert run_cli(*argv, "--prompt", PROMPT, "--max-new-tokens", str(NEW)) == 0
    assert capsys.readouterr().out == PROMPT + mixtral["text"] + "\n"


def test_export_loads_in_transformers(mixtral, tokens, tmp_path):
    name, err, same = export_round_trip(mixtral["hf"], tmp_path, tokens, mixtral["logits"])
    assert (name, same) == ("MixtralForCausalLM", True) and err <= RTOL


def test_hf_balance_loss_is_transformers(mixtral, tokens):
    """Our "hf" balance loss of the model's own routing = transformers' load_balancing_loss_func of its
    router logits (every layer's tokens pooled: ~k when balanced)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    cfg, flat = hf_weights.load_hf(mixtral["hf"])
    run = lambda t: local_logits_stats(cfg, Parallel(), t)[2]
    stats = hk.transform(run).apply(unflatten(flat), None, tokens)
    with torch.no_grad():
        router = mixtral["model"](torch.tensor(tokens), output_router_logits=True).router_logits
    want = float(load_balancing_loss_func(router, 4, 2))
    assert float(moe.balance_loss(cfg, stats)) == pytest.approx(want, rel=1e-5)


def test_unsupported_mixtral_config():
    base = hf_config.config_to_hf(get_config("tiny-mixtral").replace(router_z_loss_coef=0.0))
    with pytest.raises(ConfigError, match="router_jitter_noise"):
        hf_config.config_from_hf({**base, "router_jitter_noise": 0.1})


@pytest.mark.parametrize("preset", ["mixtral-8x7b", "mixtral-8x22b"])
def test_preset_config_round_trip(preset):
    cfg = get_config(preset)
    assert hf_config.config_from_hf(hf_config.config_to_hf(cfg)) == cfg
