"""Qwen3-MoE and OLMoE from transformers: a tiny random model of each (no download; every weight perturbed,
the norm weights away from 1) converts with logits equal to transformers' (float32, unsharded and on 2x2),
from both weight layouts (per-expert tensors, as save_pretrained writes, and transformers 5's fused
``gate_up_proj`` / ``down_proj``); `meshlm generate --temperature 0` prints transformers' greedy text on
1x1 and with ``--ep 2``; the export loads back with equal logits; the "hf" load-balancing loss is
transformers'. Qwen3-MoE renormalises its top-k (norm_topk_prob) and has an explicit head_dim; OLMoE does
not renormalise and normalizes q and k over the whole projection."""

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
    write_fused,
)

from meshlm.errors import ConfigError  # noqa: E402
from meshlm.io import hf_config, hf_weights  # noqa: E402
from meshlm.model import moe  # noqa: E402
from meshlm.model.config import get_config  # noqa: E402
from meshlm.model.params import unflatten  # noqa: E402
from meshlm.model.transformer import local_logits_stats  # noqa: E402
from meshlm.parallel.context import Parallel  # noqa: E402

SHARED = dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, intermediate_size=48, num_attention_heads=4,
    num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
    rope_parameters={"rope_type": "default", "rope_theta": 1e4}, bos_token_id=0, eos_token_id=0,
    pad_token_id=0,
)  # fmt: skip
# model_type -> (transformers classes, their config's own fields, what meshlm must read from it)
FAMILIES = {
    "qwen3_moe": (
        ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
        dict(
            moe_intermediate_size=16,
            head_dim=16,
            norm_topk_prob=True,
            router_aux_loss_coef=0.02,
            mlp_only_layers=[0],
        ),  # a dense first layer (Qwen2-MoE's rule, two parameter stacks)
        dict(
            moe_d_ff=16,
            d_ff=48,
            head_dim=16,
            norm_topk_prob=True,
            router_aux_loss_coef=0.02,
            dense_layers=(0,),
        ),
    ),
    "olmoe": (
        ("OlmoeConfig", "OlmoeForCausalLM"),
        dict(norm_topk_prob=False, router_aux_loss_coef=0.01),
        dict(moe_d_ff=48, d_ff=48, head_dim=0, norm_topk_prob=False, router_aux_loss_coef=0.01),
    ),
}


@pytest.fixture(scope="module")
def tokens():
    return random_tokens()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tokens, tmp_path_factory):
    """{name, hf (directory), fused (transformers' in-memory names), ckpt (converted, 1x1), model, logits,
    text (greedy)}: one conversion per family."""
    (config_cls, model_cls), own, _ = FAMILIES[request.param]
    torch.manual_seed(0)
    hf_cfg = getattr(transformers, config_cls)(**SHARED, **own)
    model = perturbed_model(getattr(transformers, model_cls), hf_cfg)
    root = tmp_path_factory.mktemp(request.param)
    tokenizer = bpe_tokenizer(CORPUS, VOCAB)
    model.save_pretrained(root / "hf")
    tokenizer.save_pretrained(root / "hf")
    write_fused(model, root / "hf", root / "fused")
    argv = ("convert", "--from-hf", str(root / "hf"), "--out", str(root / "ckpt"), "--mesh", "1x1")
    assert run_cli(*argv) == 0
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert len(set(out[0, ids.shape[1] :].tolist())) > 3
    return dict(name=request.param, hf=root / "hf", fused=root / "fused", ckpt=root / "ckpt", model=model,
                text=text, logits=hf_logits(model, tokens))  # fmt: skip


@pytest.mark.parametrize("layout", ["hf", "fused"])
def test_logits_equal_transformers(family, tokens, layout):
    cfg, flat = hf_weights.load_hf(family[layout])
    want = {"family": family["name"], **FAMILIES[family["name"]][2]}
    assert {k: getattr(cfg, k) for k in want} == want
    assert rel(our_logits(cfg, flat, tokens), family["logits"]) <= RTOL
    if layout == "hf":
        for copy in sharded_logits(cfg, unflatten(flat), tokens):
            assert rel(copy, family["logits"]) <= RTOL


@pytest.mark.parametrize("mesh", [("--mesh", "1x1"), ("--mesh", "2x1", "--ep", "2")], ids=["1x1", "ep2"])
def test_generate_prints_transformers_text(family, mesh, capsys):
    capsys.readouterr()
    argv = ["generate", "--checkpoint", str(family["ckpt"]), *mesh, "--temperature", "0"]
    assert run_cli(*argv, "--prompt", PROMPT, "--max-new-tokens", str(NEW)) == 0
    assert capsys.readouterr().out == PROMPT + family["text"] + "\n"


def test_export_loads_in_transformers(family, tokens, tmp_path):
    name, err, same = export_round_trip(family["hf"], tmp_path, tokens, family["logits"])
    assert (name, same) == (FAMILIES[family["name"]][0][1], True) and err <= RTOL


def test_hf_balance_loss_is_transformers(family, tokens):
    """Our "hf" balance loss of the model's own routing = transformers' load_balancing_loss_func of its
    router logits (every layer's tokens pooled)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    cfg, flat = hf_weights.load_hf(family["hf"])
    run = lambda t: local_logits_stats(cfg, Parallel(), t)[2]
    stats = hk.transform(run).apply(unflatten(flat), None, tokens)
    with torch.no_grad():
        router = family["model"](torch.tensor(tokens), output_router_logits=True).router_logits
    want = float(load_balancing_loss_func(router, 4, 2))
    assert float(moe.balance_loss(cfg, stats)) == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize(
    "preset, change, names",
    [
        ("tiny-qwen3-moe", {"mlp_only_layers": "0"}, "mlp_only_layers must be a list of layer indices"),
        ("tiny-qwen3-moe", {"use_sliding_window": True}, "use_sliding_window"),
        ("tiny-olmoe", {"clip_qkv": 8.0}, "clip_qkv=8.0"),
        ("tiny-olmoe", {"head_dim": 16}, "head_dim=16"),
    ],
)
def test_unsupported_fields_are_named(preset, change, names):
    base = hf_config.config_to_hf(get_config(preset).replace(router_z_loss_coef=0.0))
    with pytest.raises(ConfigError, match=names):
        hf_config.config_from_hf({**base, **change})


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "olmoe-1b-7b"])
def test_preset_config_round_trip(preset):
    cfg = get_config(preset)
    assert hf_config.config_from_hf(hf_config.config_to_hf(cfg)) == cfg


@pytest.mark.parametrize("preset", ["tiny-olmoe", "tiny-olmo2"])
def test_whole_projection_qk_norm_rounds_as_transformers_in_bf16(preset):
    """OLMoE's q/k norm casts to bf16 before the weight product (OlmoeRMSNorm), OLMo 2's after it
    (Olmo2RMSNorm): the family's ``Family.norm`` picks, so bf16 outputs are transformers' bit for bit."""
    import jax.numpy as jnp
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
    from transformers.models.olmoe.modeling_olmoe import OlmoeRMSNorm

    from meshlm.model.attention import QK_NORMS, Attention

    cfg = get_config(preset)
    torch.manual_seed(0)
    x, w = torch.randn(5, 16).bfloat16(), (1 + torch.randn(16)).bfloat16()
    theirs = (OlmoeRMSNorm if preset == "tiny-olmoe" else Olmo2RMSNorm)(16, eps=cfg.norm_eps).bfloat16()
    with torch.no_grad():
        theirs.weight.copy_(w)
        want = theirs(x).float().numpy()

    def norm(x):
        args = Attention(cfg=cfg, par=Parallel(), stddev=0.02)._norm_args(False)
        return QK_NORMS["proj"](eps=cfg.norm_eps, name="q_norm", **{**args, "heads": 2})(x)

    as_jax = lambda t: jnp.asarray(t.float().numpy(), jnp.bfloat16)
    params = {"q_norm": {"scale_heads": as_jax(w).reshape(2, 8)}}
    got = hk.transform(norm).apply(params, None, as_jax(x).reshape(5, 1, 2, 8))
    np.testing.assert_array_equal(np.asarray(got, np.float32).reshape(5, 16), want)
