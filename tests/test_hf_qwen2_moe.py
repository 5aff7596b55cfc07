"""Qwen2-MoE from transformers: a tiny random Qwen2MoeForCausalLM (no download; every weight perturbed,
the norm weights away from 1) with a shared expert and a dense first layer (``mlp_only_layers=[0]``)
converts with logits equal to transformers' (float32, unsharded and on 2x2; its fused in-memory
expert tensors read to the same parameters); `meshlm generate
--temperature 0` prints transformers' greedy text on 1x1 and with --ep 2; the export loads back with
equal logits; the "hf" load-balancing loss is transformers' (the sparse layers' router logits pooled)."""

import numpy as np
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
    bpe_tokenizer,
    export_round_trip,
    hf_logits,
    our_logits,
    perturbed_model,  # noqa: E402
    random_tokens,
    rel,
)

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
def qwen2_moe(tokens, tmp_path_factory):
    """{hf (directory), ckpt (converted, 1x1), model, logits, text (greedy)}."""
    torch.manual_seed(0)
    hf_cfg = transformers.Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, intermediate_size=48, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, mlp_only_layers=[0], norm_topk_prob=False,
        max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        bos_token_id=0, eos_token_id=0, router_aux_loss_coef=0.02,
    )  # fmt: skip
    model = perturbed_model(transformers.Qwen2MoeForCausalLM, hf_cfg)
    root = tmp_path_factory.mktemp("qwen2_moe")
    tokenizer = bpe_tokenizer(CORPUS, VOCAB)
    model.save_pretrained(root / "hf")
    tokenizer.save_pretrained(root / "hf")
    assert (
        run_cli("convert", "--from-hf", str(root / "hf"), "--out", str(root / "ckpt"), "--mesh", "1x1") == 0
    )
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert len(set(out[0, ids.shape[1] :].tolist())) > 3
    return dict(hf=root / "hf", ckpt=root / "ckpt", model=model, text=text, logits=hf_logits(model, tokens))


def test_logits_equal_transformers(qwen2_moe, tokens, tmp_path):
    cfg, flat = hf_weights.load_hf(qwen2_moe["hf"])
    assert cfg.family == "qwen2_moe" and cfg.dense_layers == (0,) and cfg.shared_expert_d_ff == 24
    assert not cfg.norm_topk_prob and "dense_layers/mlp/w_gate" in flat
    assert rel(our_logits(cfg, flat, tokens), qwen2_moe["logits"]) <= RTOL
    for copy in sharded_logits(cfg, unflatten(flat), tokens):
        assert rel(copy, qwen2_moe["logits"]) <= RTOL
    # transformers 5's in-memory names (fused gate_up_proj / down_proj) read to the very same parameters
    import shutil

    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in qwen2_moe["model"].state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    shutil.copy(qwen2_moe["hf"] / "config.json", tmp_path / "config.json")
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    fused = hf_weights.load_hf(tmp_path)[1]
    assert fused.keys() == flat.keys() and all(np.array_equal(fused[k], flat[k]) for k in flat)


@pytest.mark.parametrize("mesh", [("1x1",), ("2x1", "--ep", "2", "--devices", "2")], ids=["1x1", "ep2"])
def test_generate_prints_transformers_text(qwen2_moe, mesh, capsys):
    capsys.readouterr()
    argv = ["generate", "--checkpoint", str(qwen2_moe["ckpt"]), "--mesh", *mesh, "--temperature", "0"]
    assert run_cli(*argv, "--prompt", PROMPT, "--max-new-tokens", str(NEW)) == 0
    assert capsys.readouterr().out == PROMPT + qwen2_moe["text"] + "\n"


def test_export_loads_in_transformers(qwen2_moe, tokens, tmp_path):
    name, err, same = export_round_trip(qwen2_moe["hf"], tmp_path, tokens, qwen2_moe["logits"])
    assert (name, same) == ("Qwen2MoeForCausalLM", True) and err <= RTOL


def test_hf_balance_loss_is_transformers(qwen2_moe, tokens):
    """Our "hf" balance loss = transformers' load_balancing_loss_func of its router logits: the sparse
    layers' only (the dense layer 0 has no router), every token of theirs pooled."""
    from transformers.models.qwen2_moe.modeling_qwen2_moe import load_balancing_loss_func

    cfg, flat = hf_weights.load_hf(qwen2_moe["hf"])
    run = lambda t: local_logits_stats(cfg, Parallel(), t)[2]
    stats = hk.transform(run).apply(unflatten(flat), None, tokens)
    with torch.no_grad():
        router = qwen2_moe["model"](torch.tensor(tokens), output_router_logits=True).router_logits
    assert stats.shape[0] == len(router) == 2
    want = float(load_balancing_loss_func(router, 4, 2))
    assert float(moe.balance_loss(cfg, stats)) == pytest.approx(want, rel=1e-5)


def test_qwen2_moe_config_fields():
    """decoder_sparse_step's rule (transformers'), the refusals by name, the presets' round trip."""
    base = hf_config.config_to_hf(get_config("tiny-qwen2-moe").replace(router_z_loss_coef=0.0))
    stepped = hf_config.config_from_hf({**base, "num_hidden_layers": 5, "decoder_sparse_step": 2})
    assert stepped.dense_layers == (0, 2, 4)  # sparse iff (i + 1) % 2 == 0 and i not in [0]
    refused = (("qkv_bias", False), ("shared_expert_intermediate_size", 0), ("use_sliding_window", True))
    for key, value in refused:
        with pytest.raises(ConfigError, match=key):
            hf_config.config_from_hf({**base, key: value})
    for preset in ("qwen2-moe-a2.7b",):
        cfg = get_config(preset)
        assert hf_config.config_from_hf(hf_config.config_to_hf(cfg)) == cfg
