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
