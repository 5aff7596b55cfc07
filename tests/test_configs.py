"""`meshlm configs` (a table unless --json), the real-size presets' parameter counts, and the
``rope_scaling`` config field (recorded in checkpoints' JSON; configs saved before it load unscaled)."""

import json

import pytest
from helpers import run_cli

from meshlm.errors import ConfigError
from meshlm.model.config import from_dict, get_config

# Parameter counts of the published models (their model cards: 8.03B, 70.6B, 7.62B).
PUBLISHED = {"llama3-8b": "8.03B", "llama3.1-70b": "70.55B", "qwen2.5-7b": "7.62B"}


# slow: its cost is its scale (every preset's shapes traced for its counts, ~20 s of CPU); the documented
# meshlm configs --json runs quick (tests/test_docs_commands.py), and so does the count rule
# (test_active_parameters_count_k_of_e_experts)
@pytest.mark.slow
def test_configs_prints_a_table_and_json_lines(capsys):
    assert run_cli("configs") == 0
    lines = capsys.readouterr().out.splitlines()
    head = ["preset", "family", "layers", "d_model", "heads/KV", "vocab", "parameters", "active"]
    assert lines[0].split() == head
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert rows["llama3.1-70b"][1:8] == ["llama", "80", "8192", "64/8", "128256", "70.55B", "70.55B"]
    assert rows["qwen2.5-7b"][1:8] == ["qwen2", "28", "3584", "28/4", "152064", "7.62B", "7.62B"]
    assert rows["tiny-llama3"][-1] == "tied" and rows["llama3-8b"][6] == PUBLISHED["llama3-8b"]
    # Mixtral's model card: 46.7B parameters, 12.9B active (2 of 8 experts per token).
    assert rows["mixtral-8x7b"][6:8] == ["46.70B", "12.88B"]
    assert run_cli("configs", "--json") == 0
    objs = {o["name"]: o for o in map(json.loads, capsys.readouterr().out.splitlines())}
    assert list(objs) == list(rows)
    assert objs["llama3-8b"]["params"] == objs["llama3-8b"]["active_params"] == 8_030_261_248
    assert objs["mixtral-8x7b"]["params"] == 46_702_792_704


def test_configs_table_and_json_of_two_presets(capsys, monkeypatch):
    """`meshlm configs` and `--json` on two presets (every preset's: the slow test above, and the
    docs' command in the slow tier): the table's columns, a MoE's active count, the same rows."""
    import meshlm.model.config as config

    monkeypatch.setattr(config, "PRESETS", {n: config.PRESETS[n] for n in ("tiny-llama3", "tiny-mixtral")})
    assert run_cli("configs") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == [
        "preset",
        "family",
        "layers",
        "d_model",
        "heads/KV",
        "vocab",
        "parameters",
        "active",
    ]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert list(rows) == ["tiny-llama3", "tiny-mixtral"] and rows["tiny-llama3"][-1] == "tied"
    assert run_cli("configs", "--json") == 0
    objs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [o["name"] for o in objs] == list(rows)
    assert objs[1]["active_params"] < objs[1]["params"]  # 2 of the experts a token


def test_active_parameters_count_k_of_e_experts():
    """Active = total less (1 - k/E) of every expert weight [E, ...]; the FLOPs of MFU count them too."""
    from meshlm.model.accounting import param_counts
    from meshlm.model.transformer import param_shapes
    from meshlm.perf.flops import matmul_param_count

    cfg = get_config("mixtral-8x7b")
    layers, d, e, i = cfg.n_layers, cfg.d_model, cfg.n_experts, cfg.moe_d_ff
    counts = param_counts(cfg)
    assert counts.total - counts.active == 3 * layers * d * i * (e - cfg.experts_per_token)
    dense = get_config("llama3-8b")
    assert param_counts(dense).active == param_counts(dense).total
    # N of 6·N·tokens: the matmul weights a token uses (the embedding lookup is none: untied head).
    shapes = param_shapes(cfg)
    embed = shapes["embed"]["embeddings"].size
    padded = sum(x.size for m in shapes.values() for x in m.values()) - embed
    norms = (2 * layers + 1) * d
    assert matmul_param_count(cfg, shapes) == padded - norms - (counts.total - counts.active)
    from meshlm.parallel.mesh import make_mesh
    from meshlm.perf.memory import memory_report

    assert memory_report(cfg, make_mesh(1, 2))["active_params"] == counts.active  # 32000: no padding


def test_rope_scaling_round_trips_and_old_configs_load_unscaled():
    cfg = get_config("llama3.1-70b")
    assert from_dict(json.loads(cfg.to_json())) == cfg and cfg.rope_scaling.factor == 8.0
    old = {k: v for k, v in get_config("tiny-llama").to_dict().items() if k != "rope_scaling"}
    assert from_dict(old).rope_scaling is None
    scaled, plain = get_config("tiny-llama3"), get_config("tiny-llama3").replace(rope_scaling=None)
    assert (scaled.inv_freq() < plain.inv_freq()).sum() == 4  # every frequency of head_dim 8 moved


@pytest.mark.parametrize(
    "value, problem",
    [
        ({"factor": 8.0}, "rope_scaling must be null or an object with exactly"),
        (
            {"factor": 0, "low_freq_factor": 1, "high_freq_factor": 4, "original_max_position_embeddings": 8},
            "factor",
        ),
        (
            {"factor": 8, "low_freq_factor": 4, "high_freq_factor": 1, "original_max_position_embeddings": 8},
            "at least",
        ),
    ],
)
def test_bad_rope_scaling_names_the_field(value, problem):
    with pytest.raises(ConfigError, match=problem):
        get_config("tiny-llama").replace(rope_scaling=value)


# The published config.json values of the presets that fill one chip (hub ids in the comments).
ONE_CHIP = {
    # Qwen/Qwen3-0.6B, Qwen/Qwen3-1.7B
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28),
    # meta-llama/Llama-3.2-1B, HuggingFaceTB/SmolLM2-360M
    "llama3.2-1b": dict(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        max_position_embeddings=131072,
    ),
    "smollm2-360m": dict(
        vocab_size=49152,
        hidden_size=960,
        intermediate_size=2560,
        num_hidden_layers=32,
        num_attention_heads=15,
        num_key_value_heads=5,
        head_dim=64,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
    ),
}
QWEN3_SMALL = dict(
    vocab_size=151936,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    max_position_embeddings=40960,
)


@pytest.mark.parametrize("name", sorted(ONE_CHIP))
def test_one_chip_presets_are_their_published_config(name):
    """Written back as transformers' config.json, each is the published one (the fields it states)."""
    from meshlm.io.hf_config import config_to_hf

    hf = config_to_hf(get_config(name))
    want = ONE_CHIP[name] | (QWEN3_SMALL if name.startswith("qwen3") else {})
    assert {k: hf[k] for k in want} == want
    if name == "llama3.2-1b":  # Llama 3.1's frequency scaling, factor 32 over 8192
        scaling = {
            k: hf["rope_scaling"][k] for k in ("rope_type", "factor", "low_freq_factor", "high_freq_factor")
        }
        assert scaling == {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        }
        assert hf["rope_scaling"]["original_max_position_embeddings"] == 8192
