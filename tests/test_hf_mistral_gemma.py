"""Mistral (sliding-window attention) and Gemma from transformers: a tiny random model of each (no
download) converts with logits equal to transformers' (float32, unsharded and on 2x2), `meshlm generate
--temperature 0` prints transformers' greedy text past the window, and the export loads back. The window
off by one is common to the sharded and unsharded runs, so only this comparison can catch it: shown."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers import run_cli, sharded_logits  # noqa: E402
from hf_helpers import CORPUS, NEW, PROMPT, RTOL, VOCAB, bpe_tokenizer, export_round_trip  # noqa: E402  # noqa: E402
from hf_helpers import hf_logits as _hf_logits  # noqa: E402
from hf_helpers import our_logits as _our_logits  # noqa: E402
from hf_helpers import rel as _rel  # noqa: E402

from meshlm.errors import ConfigError  # noqa: E402
from meshlm.io import hf_config, hf_weights  # noqa: E402
from meshlm.model import attention, transformer  # noqa: E402
from meshlm.model.params import unflatten  # noqa: E402

WINDOW = 4  # smaller than the prompt, the generation and the logits test's sequence
SMALL = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, intermediate_size=64, bos_token_id=0)
HF_CONFIGS = {
    "mistral": lambda: transformers.MistralConfig(
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        sliding_window=WINDOW,
        rope_theta=500.0,
        eos_token_id=0,
        **SMALL,
    ),
    "gemma": lambda: transformers.GemmaConfig(
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,  # not hidden_size / heads (Gemma-7b: 256 x 16 heads on d_model 3072)
        max_position_embeddings=64,
        eos_token_id=0,
        **SMALL,
    ),
}
MODEL_CLASSES = {"mistral": "MistralForCausalLM", "gemma": "GemmaForCausalLM"}


@pytest.fixture(scope="module")
def tokenizer():
    return bpe_tokenizer(CORPUS, VOCAB)


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, VOCAB, (2, 4 * WINDOW))


@pytest.fixture(scope="module", params=list(HF_CONFIGS))
def family(request, tokenizer, tokens, tmp_path_factory):
    """{name, hf (directory), ckpt (converted, 1x1), model, logits, text (greedy, past the window)}.

    Every parameter is perturbed (Gemma's norm weights start at 0) so a wrong mapping of any shows."""
    torch.manual_seed(0)
    hf_cfg = HF_CONFIGS[request.param]()
    hf_cfg.initializer_range = 0.3  # peaked logits: greedy is neither degenerate nor near a tie
    model = getattr(transformers, MODEL_CLASSES[request.param])(hf_cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    root = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(root / "hf")
    tokenizer.save_pretrained(root / "hf")
    assert (
        run_cli("convert", "--from-hf", str(root / "hf"), "--out", str(root / "ckpt"), "--mesh", "1x1") == 0
    )
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    assert ids.shape[1] > WINDOW
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert len(set(out[0, ids.shape[1] :].tolist())) > 3
    return dict(
        name=request.param, hf=root / "hf", ckpt=root / "ckpt", model=model, text=text,
        logits=_hf_logits(model, tokens),
    )  # fmt: skip


def test_logits_equal_transformers(family, tokens):
    cfg, flat = hf_weights.load_hf(family["hf"])
    assert cfg.family == family["name"]
    assert _rel(_our_logits(cfg, flat, tokens), family["logits"]) <= RTOL
    for copy in sharded_logits(cfg, unflatten(flat), tokens):
        assert _rel(copy, family["logits"]) <= RTOL


@pytest.mark.parametrize("mesh", ["1x1", "1x2", "2x2"])
def test_generate_prints_transformers_text(family, mesh, capsys):
    capsys.readouterr()
    argv = ["generate", "--checkpoint", str(family["ckpt"]), "--mesh", mesh, "--temperature", "0"]
    assert run_cli(*argv, "--prompt", PROMPT, "--max-new-tokens", str(NEW)) == 0
    assert capsys.readouterr().out == PROMPT + family["text"] + "\n"


def test_export_loads_in_transformers(family, tokens, tmp_path):
    name, err, same = export_round_trip(family["hf"], tmp_path, tokens, family["logits"])
    assert (name, same) == (MODEL_CLASSES[family["name"]], True) and err <= RTOL


# Bugs in code the sharded and the unsharded model share: verify cannot see them, transformers can.
SHARED_BUGS = {
    # the window one key too wide: i - window <= j
    "mistral": (attention, "window_visible", lambda q, k, w: (k <= q) & (k >= q - w)),
    # the embeddings not scaled by sqrt(d_model)
    "gemma": (transformer, "embed_scale", lambda d: 1.0),
}


@pytest.mark.parametrize("family", list(SHARED_BUGS), indirect=True)
def test_a_bug_common_to_both_runs_fails_the_transformers_comparison(family, tokens, monkeypatch):
    cfg, flat = hf_weights.load_hf(family["hf"])
    assert cfg.sliding_window == (WINDOW if family["name"] == "mistral" else 0)
    monkeypatch.setattr(*SHARED_BUGS[family["name"]])
    assert _rel(_our_logits(cfg, flat, tokens), family["logits"]) > 100 * RTOL


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_unsupported_mistral_config(changes, field):
    from meshlm.model.config import get_config

    base = hf_config.config_to_hf(get_config("tiny-llama").replace(family="mistral", sliding_window=8))
    with pytest.raises(ConfigError, match=field):
        hf_config.config_from_hf({**base, **changes})


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
        ({"sliding_window": 4096}, "sliding_window"),
        ({"query_pre_attn_scalar": 256}, "query_pre_attn_scalar"),
        ({"hidden_activation": "gelu"}, "hidden_activation"),
        ({"hidden_act": "silu"}, "hidden_act"),
        # the multimodal Gemma 3 (Gemma 2 and Gemma 3 text are families of their own)
        ({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]}, "model_type"),
    ],
)
def test_unsupported_gemma_config(changes, field):
    from meshlm.model.config import get_config

    base = hf_config.config_to_hf(get_config("tiny-gemma"))
    with pytest.raises(ConfigError, match=field):
        hf_config.config_from_hf({**base, **changes})


def test_mistral_config_window_defaults_and_export_refusals():
    from meshlm.model.config import from_dict, get_config
    from meshlm.model.families import mistral

    cfg = get_config("tiny-llama").replace(family="mistral", sliding_window=8)
    hf = hf_config.config_to_hf(cfg)
    assert hf["sliding_window"] == 8 and hf_config.config_from_hf(hf) == cfg
    assert hf_config.config_from_hf({**hf, "sliding_window": None}).sliding_window == 0  # v0.3
    del hf["sliding_window"]  # transformers' default
    assert hf_config.config_from_hf(hf).sliding_window == mistral.WINDOW
    with pytest.raises(ConfigError, match="sliding_window=8: transformers' llama"):
        hf_config.config_to_hf(cfg.replace(family="llama"))
    assert cfg.replace(attention="blockwise").sliding_window == 8  # the kernel skips and masks by window
    with pytest.raises(ConfigError, match="sliding_window=8 needs a family with attention"):
        get_config("seed").replace(sliding_window=8)
    saved = cfg.to_dict()
    del saved["sliding_window"]  # a checkpoint written before the field: no window
    assert from_dict(saved).sliding_window == 0


@pytest.mark.parametrize("preset", ["tiny-mistral", "tiny-gemma", "mistral-7b", "gemma-7b"])
def test_preset_config_round_trip(preset):
    from meshlm.model.config import get_config

    cfg = get_config(preset)
    assert hf_config.config_from_hf(hf_config.config_to_hf(cfg)) == cfg


@pytest.mark.parametrize("family", ["mistral"], indirect=True)
def test_rolling_cache_holds_the_window_and_equals_transformers(family, tokens, capsys):
    """Mistral's every layer is windowed: the decode cache holds WINDOW positions, not the 64-token
    context (generate --json reports it), the greedy text past several windows is transformers', and
    teacher-forced cached logits through 4 windows equal transformers' logits."""
    import json

    from meshlm.generate.generator import Generator, cache_memory
    from meshlm.parallel.mesh import make_mesh

    capsys.readouterr()
    argv = ["generate", "--checkpoint", str(family["ckpt"]), "--mesh", "1x1", "--temperature", "0", "--json"]
    assert run_cli(*argv, "--prompt", PROMPT, "--max-new-tokens", str(NEW)) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["text"] == family["text"] and out["kv_cache"]["slots"] == WINDOW
    cfg, flat = hf_weights.load_hf(family["hf"])
    gen = Generator(cfg, unflatten(flat), make_mesh(1, 1))
    assert gen.max_len > 4 * WINDOW and cache_memory(gen, 2)["slots"] == WINDOW
    lengths = np.array([1, WINDOW + 1])
    got = gen.logits_with_cache(tokens, lengths)
    for b, n in enumerate(lengths):
        assert _rel(got[b], family["logits"][b, n - 1 :]) <= RTOL
