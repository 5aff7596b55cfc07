"""`meshlm configs` (a table unless --json), the real-size presets' parameter counts, and the
``rope_scaling`` config field (recorded in checkpoints' JSON; configs saved before it load unscaled)."""

import json

import pytest
from helpers import run_cli

from meshlm.errors import ConfigError
from meshlm.model.config import from_dict, get_config

# Parameter counts of the published models (their model cards: 8.03B, 70.6B, 7.62B).
PUBLISHED = {"llama3-8b": "8.03B", "llama3.1-70b": "70.55B", "qwen2.5-7b": "7.62B"}


def test_configs_prints_a_table_and_json_lines(capsys):
    assert run_cli("configs") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["preset", "family", "layers", "d_model", "heads/KV", "vocab", "parameters"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert rows["llama3.1-70b"][1:7] == ["llama", "80", "8192", "64/8", "128256", "70.55B"]
    assert rows["qwen2.5-7b"][1:7] == ["qwen2", "28", "3584", "28/4", "152064", "7.62B"]
    assert rows["tiny-llama3"][-1] == "tied" and rows["llama3-8b"][6] == PUBLISHED["llama3-8b"]
    assert run_cli("configs", "--json") == 0
    objs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [o["name"] for o in objs] == list(rows)
    assert next(o for o in objs if o["name"] == "llama3-8b")["params"] == 8_030_261_248


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
            "exceed",
        ),
    ],
)
def test_bad_rope_scaling_names_the_field(value, problem):
    with pytest.raises(ConfigError, match=problem):
        get_config("tiny-llama").replace(rope_scaling=value)
