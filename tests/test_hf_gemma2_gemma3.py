"""Gemma 2 (sandwich block, alternating local/global layers, query_pre_attn_scalar, attention and final
soft-capping) and Gemma 3 (per-head (1 + w) q/k norm, local/global layers with two rotary bases, linear
scaling on the global ones) from transformers: a tiny random model of each (eager attention, no
download, every weight perturbed: the norm weights away from 0) converts with logits equal to
transformers' on 16 tokens, 4 times the window (float32, unsharded and on 2x2), `meshlm generate
--temperature 0` prints transformers' greedy text on 1x1 and 1x2 (4 windows long: the local layers' KV
cache rolls over the window), and the export loads back with equal
logits."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_harness import Case, Comparison, GreedyText, drift, family_fixture, kv_slots  # noqa: E402
from hf_helpers import ROPE, RTOL, TINY  # noqa: E402

from meshlm.errors import ConfigError  # noqa: E402
from meshlm.io import hf_config  # noqa: E402
from meshlm.model import attention  # noqa: E402
from meshlm.model.config import get_config  # noqa: E402

NEW = 16  # 4 windows: the local layers' rolling caches wrap several times
WINDOW = 4  # < the 16 tokens compared and the prompt: every local layer's window matters
SMALL = dict(**TINY, intermediate_size=64, head_dim=16, sliding_window=WINDOW, pad_token_id=0)
SMALL |= dict(query_pre_attn_scalar=12)  # != head_dim: the scale matters
LOCAL, GLOBAL = "sliding_attention", "full_attention"


# initializer_range 0.1: greedy neither degenerate (0.3: one token repeated) nor near a tie; every
# parameter perturbed, the norm weights by 0.3 (far from 0: their (1 + w) far from 1); the local layers'
# KV cache holds their window (rolling), the global layers' the whole context (``model.kv_kinds``)
GEMMA = dict(init=0.1, seed=1, eager=True, new=NEW, generated=kv_slots(WINDOW, 3 * WINDOW))
family = family_fixture(
    [
        Case(
            "gemma2",
            "Gemma2ForCausalLM",
            lambda: transformers.Gemma2Config(
                num_hidden_layers=4,  # local, global, local, global
                attn_logit_softcapping=10.0,  # small enough to bend the perturbed model's scores and logits
                final_logit_softcapping=15.0,
                rope_parameters=ROPE,
                **SMALL,
            ),
            reads=dict(global_every=2, sliding_window=WINDOW),
            **GEMMA,
        ),
        Case(
            "gemma3",
            "Gemma3ForCausalLM",
            lambda: transformers.Gemma3TextConfig(
                num_hidden_layers=6,
                layer_types=[LOCAL, LOCAL, GLOBAL] * 2,
                rope_parameters={
                    GLOBAL: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                    LOCAL: {"rope_type": "default", "rope_theta": 1e4},
                },
                **SMALL,
            ),
            reads=dict(global_every=3, sliding_window=WINDOW),
            **GEMMA,
        ),
    ]
)


class TestTransformers(Comparison, GreedyText):
    """Logits unsharded and on 2x2, the export, greedy text on 1x1 and 1x2 past several windows
    (tests/hf_harness.py)."""


def test_each_layer_kind_matters(family):
    """The same weights with every layer global (no window, the global rotary) are far from
    transformers': the comparison above sees the kinds."""
    assert drift(family, global_every=1, rope_local_theta=0.0) > 100 * RTOL


def test_released_gemma3_config_reads_as_transformers():
    """gemma-3's released config.json spelling (rope_theta, rope_local_base_freq, rope_scaling,
    sliding_window_pattern, no layer_types) reads as transformers 5 reads it."""
    released = {
        **{k: v for k, v in hf_config.config_to_hf(get_config("gemma3-1b")).items() if "rope" not in k},
        "rope_theta": 1000000,
        "rope_local_base_freq": 10000,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "sliding_window_pattern": 6,
    }
    del released["layer_types"]
    cfg = hf_config.config_from_hf(released)
    theirs = transformers.Gemma3TextConfig(**released)
    assert attention.layer_kinds(cfg).tolist() == [int(k == GLOBAL) for k in theirs.layer_types]
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_linear) == (1e6, 1e4, 8.0)
    assert theirs.rope_parameters[GLOBAL]["factor"] == 8.0
    assert cfg == get_config("gemma3-1b").replace(rope_linear=8.0)


@pytest.mark.parametrize(
    "preset, changes, field",
    [
        ("tiny-gemma2", {"layer_types": [LOCAL, GLOBAL, GLOBAL, LOCAL]}, "layer_types"),
        ("tiny-gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ("tiny-gemma2", {"hidden_activation": "gelu"}, "hidden_activation"),
        ("tiny-gemma2", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "rope"),
        ("tiny-gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ("tiny-gemma3", {"rope_parameters": {LOCAL: {"rope_type": "linear", "factor": 2.0}}}, "rope_type"),
        ("tiny-gemma3", {"rope_parameters": {GLOBAL: {"rope_type": "yarn", "factor": 2.0}}}, "rope_type"),
    ],
)
def test_unsupported_config(preset, changes, field):
    base = hf_config.config_to_hf(get_config(preset))
    with pytest.raises(ConfigError, match=field):
        hf_config.config_from_hf({**base, **changes})


@pytest.mark.parametrize("preset", ["tiny-gemma2", "gemma2-9b", "gemma2-27b", "tiny-gemma3", "gemma3-1b"])
def test_preset_config_round_trip(preset):
    cfg = get_config(preset)
    assert hf_config.config_from_hf(hf_config.config_to_hf(cfg)) == cfg


def test_pipeline_chunks_keep_the_layer_pattern():
    """Each pipeline chunk numbers its layers from 0: a chunk that splits the local/global pattern is
    refused in one line (tiny-gemma3: 6 layers, every third global; pp 2 gives chunks of 3, pp 3 of 2)."""
    from meshlm.errors import ShardingError
    from meshlm.parallel.layout import Layout
    from meshlm.sharding.pipelined import check_pipelined

    cfg = get_config("tiny-gemma3")
    check_pipelined(cfg, Layout(pp=2, microbatches=2))
    with pytest.raises(ShardingError, match=r"layer by layer mmMmmM; global_every=3\).*; use --pp 2$"):
        check_pipelined(cfg, Layout(pp=3, microbatches=3))
