"""OLMo 3 (OLMo 2's block with a sliding window on three of four layers, ``layer_types``) and SmolLM3
(Llama's block with NoPE on every fourth layer, ``no_rope_layers``, tied embeddings) from transformers:
a tiny random model of each (eager attention, no download, every weight perturbed) converts with
logits equal to transformers' on 16 tokens, 4 times OLMo 3's window (float32, unsharded and on 2x2),
`meshlm generate --temperature 0` prints transformers' greedy text on 1x1 and 1x2 (past several
windows: the sliding layers' cache rolls), and the export loads back with equal logits. A NoPE layer
rotated in code both runs would share fails the comparison (shown). Both scale with YaRN (x4 over 8
positions): OLMo 3 its full layers only (frequencies and cos/sin), SmolLM3 every rotated layer."""

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers import run_cli, sharded_logits  # noqa: E402
from hf_helpers import (  # noqa: E402
    CORPUS,
    PROMPT,
    RTOL,
    VOCAB,
    bpe_tokenizer,
    export_round_trip,
    hf_logits,
    our_logits,
    random_tokens,
    rel,
)

from meshlm.errors import ConfigError  # noqa: E402
from meshlm.io import hf_config, hf_weights  # noqa: E402
from meshlm.model import attention  # noqa: E402
from meshlm.model.config import get_config  # noqa: E402
from meshlm.model.params import unflatten  # noqa: E402
from meshlm.model.rope import YarnScaling  # noqa: E402

NEW = 16  # 4 windows: OLMo 3's sliding layers' rolling caches wrap several times
WINDOW = 4
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
)
LOCAL, GLOBAL = "sliding_attention", "full_attention"
YARN = dict(factor=4.0, original_max_position_embeddings=8, beta_fast=32.0, beta_slow=1.0)
HF_CONFIGS = {
    "olmo3": lambda: transformers.Olmo3Config(
        sliding_window=WINDOW,
        rope_parameters={  # the two kinds' bases differ: each layer must take its own
            LOCAL: {"rope_type": "default", "rope_theta": 1e4},
            GLOBAL: {"rope_type": "yarn", "rope_theta": 5e5, **YARN},
        },
        **SMALL,
    ),
    "smollm3": lambda: transformers.SmolLM3Config(
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, **YARN}, **SMALL
    ),  # no_rope_layers from the interval 4: the fourth layer NoPE; tied embeddings
}
MODEL_CLASSES = {"olmo3": "Olmo3ForCausalLM", "smollm3": "SmolLM3ForCausalLM"}
INIT = {"olmo3": 0.1, "smollm3": 0.3}  # greedy neither degenerate (one token repeated) nor near a tie
SCALING = YarnScaling(**YARN)
EXPECTED = {
    "olmo3": dict(
        global_every=4, sliding_window=WINDOW, rope_local_theta=1e4, rope_theta=5e5, rope_scaling=SCALING
    ),
    "smollm3": dict(
        global_every=4, global_nope=True, tie_embeddings=True, sliding_window=0, rope_scaling=SCALING
    ),
}


@pytest.fixture(scope="module")
def tokenizer():
    return bpe_tokenizer(CORPUS, VOCAB)


@pytest.fixture(scope="module")
def tokens():
    return random_tokens()


@pytest.fixture(scope="module", params=list(HF_CONFIGS))
def family(request, tokenizer, tokens, tmp_path_factory):
    """{name, hf (directory), ckpt (converted, 1x1), model, logits, text (greedy)}."""
    torch.manual_seed(1)
    hf_cfg = HF_CONFIGS[request.param]()
    hf_cfg.initializer_range = INIT[request.param]
    hf_cfg._attn_implementation = "eager"
    model = getattr(transformers, MODEL_CLASSES[request.param])(hf_cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if "norm" in name else 0.05))
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
        logits=hf_logits(model, tokens),
    )  # fmt: skip


def test_logits_equal_transformers(family, tokens):
    cfg, flat = hf_weights.load_hf(family["hf"])
    assert cfg.family == family["name"]
    assert {k: getattr(cfg, k) for k in EXPECTED[family["name"]]} == EXPECTED[family["name"]]
    assert rel(our_logits(cfg, flat, tokens), family["logits"]) <= RTOL
    for copy in sharded_logits(cfg, unflatten(flat), tokens):
        assert rel(copy, family["logits"]) <= RTOL


@pytest.mark.parametrize("mesh", ["1x1", "1x2"])
def test_generate_prints_transformers_text(family, mesh, capsys):
    """OLMo 3's sliding layers keep a rolling cache of their window, its full layer the context;
    SmolLM3's layers all keep the context (NoPE changes no cache), as generate --json reports."""
    capsys.readouterr()
    argv = ["generate", "--checkpoint", str(family["ckpt"]), "--mesh", mesh, "--temperature", "0", "--json"]
    assert run_cli(*argv, "--prompt", PROMPT, "--max-new-tokens", str(NEW)) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["text"] == family["text"]
    local = out["kv_cache"].get("local_slots")
    assert local == (WINDOW if family["name"] == "olmo3" else None) and out["kv_cache"]["slots"] > 3 * WINDOW


def test_export_loads_in_transformers(family, tokens, tmp_path):
    name, err, same = export_round_trip(
        family["hf"], tmp_path, tokens, family["logits"], attn_implementation="eager"
    )
    assert (name, same) == (MODEL_CLASSES[family["name"]], True) and err <= RTOL


@pytest.mark.parametrize("family", ["smollm3"], indirect=True)
def test_a_rotated_nope_layer_fails_the_transformers_comparison(family, tokens, monkeypatch):
    """The NoPE layer rotated as the others (``global_nope`` dropped from the kind tables), in code both
    verify's runs would share: only transformers' logits see it."""
    cfg, flat = hf_weights.load_hf(family["hf"])
    tables = attention.kind_tables
    monkeypatch.setattr(attention, "kind_tables", lambda c: tables(c.replace(global_nope=False)))
    assert rel(our_logits(cfg, flat, tokens), family["logits"]) > 100 * RTOL


@pytest.mark.parametrize(
    "preset, changes, message",
    [
        ("tiny-olmo3", {"rope_parameters": {LOCAL: {"rope_type": "yarn", **YARN}}}, "full layers' RoPE only"),
        ("tiny-olmo3", {"rope_scaling": {"rope_type": "yarn", "factor": 8.0}}, "original_max_position"),
        ("tiny-olmo3", {"layer_types": [GLOBAL, LOCAL, LOCAL, LOCAL]}, "repeating"),
        ("tiny-smollm3", {"use_sliding_window": True}, "use_sliding_window"),
        ("tiny-smollm3", {"no_rope_layers": [1, 0, 1, 1]}, "repeating"),
    ],
)  # fmt: skip
def test_unsupported_config_is_one_line(preset, changes, message):
    base = hf_config.config_to_hf(get_config(preset))
    with pytest.raises(ConfigError, match=message) as e:
        hf_config.config_from_hf({**base, **changes})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("preset", ["tiny-olmo3", "olmo3-7b", "tiny-smollm3", "smollm3-3b"])
def test_preset_config_round_trip(preset):
    cfg = get_config(preset)
    assert hf_config.config_from_hf(hf_config.config_to_hf(cfg)) == cfg


def test_smollm3_interval_and_olmo3_defaults_read_as_transformers():
    """no_rope_layer_interval alone (no list) and an interval past the last layer (no NoPE layer);
    OLMo 3's layer kinds from the default pattern."""
    base = hf_config.config_to_hf(get_config("tiny-smollm3"))
    del base["no_rope_layers"]
    assert hf_config.config_from_hf({**base, "no_rope_layer_interval": 2}).global_every == 2
    plain = hf_config.config_from_hf({**base, "no_rope_layer_interval": 5})
    assert (plain.global_every, plain.global_nope) == (0, False)
    olmo3 = hf_config.config_to_hf(get_config("olmo3-7b"))
    del olmo3["layer_types"]
    assert hf_config.config_from_hf(olmo3).global_every == 4
