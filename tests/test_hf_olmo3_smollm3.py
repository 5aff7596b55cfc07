"""OLMo 3 (OLMo 2's block with a sliding window on three of four layers, ``layer_types``) and SmolLM3
(Llama's block with NoPE on every fourth layer, ``no_rope_layers``, tied embeddings) from transformers:
a tiny random model of each (eager attention, no download, every weight perturbed) converts with
logits equal to transformers' on 16 tokens, 4 times OLMo 3's window (float32, unsharded and on 2x2),
`meshlm generate --temperature 0` prints transformers' greedy text on 1x1 and 1x2 (past several
windows: the sliding layers' cache rolls), and the export loads back with equal logits. A NoPE layer
rotated in code both runs would share fails the comparison (shown). Both scale with YaRN (x4 over 8
positions): OLMo 3 its full layers only (frequencies and cos/sin), SmolLM3 every rotated layer."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_harness import Case, Comparison, GreedyText, drift, family_fixture, kv_slots  # noqa: E402
from hf_helpers import RTOL, TINY  # noqa: E402

from meshlm.errors import ConfigError  # noqa: E402
from meshlm.io import hf_config  # noqa: E402
from meshlm.model import attention  # noqa: E402
from meshlm.model.config import get_config  # noqa: E402
from meshlm.model.rope import YarnScaling  # noqa: E402

NEW = 16  # 4 windows: OLMo 3's sliding layers' rolling caches wrap several times
WINDOW = 4
SMALL = dict(**TINY, intermediate_size=64, num_hidden_layers=4, pad_token_id=0)
LOCAL, GLOBAL = "sliding_attention", "full_attention"
YARN = dict(factor=4.0, original_max_position_embeddings=8, beta_fast=32.0, beta_slow=1.0)
SCALING = YarnScaling(**YARN)


# initializer_range per family: greedy neither degenerate (one token repeated) nor near a tie
BOTH = dict(seed=1, eager=True, new=NEW)
family = family_fixture(
    [
        Case(
            "olmo3",
            "Olmo3ForCausalLM",
            lambda: transformers.Olmo3Config(
                sliding_window=WINDOW,
                rope_parameters={  # the two kinds' bases differ: each layer must take its own
                    LOCAL: {"rope_type": "default", "rope_theta": 1e4},
                    GLOBAL: {"rope_type": "yarn", "rope_theta": 5e5, **YARN},
                },
                **SMALL,
            ),
            reads=dict(
                global_every=4,
                sliding_window=WINDOW,
                rope_local_theta=1e4,
                rope_theta=5e5,
                rope_scaling=SCALING,
            ),
            init=0.1,
            generated=kv_slots(WINDOW, 3 * WINDOW),  # sliding layers roll, the full one not
            **BOTH,
        ),
        Case(
            "smollm3",
            "SmolLM3ForCausalLM",
            lambda: transformers.SmolLM3Config(
                rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, **YARN}, **SMALL
            ),  # no_rope_layers from the interval 4: the fourth layer NoPE; tied embeddings
            reads=dict(
                global_every=4, global_nope=True, tie_embeddings=True, sliding_window=0, rope_scaling=SCALING
            ),
            init=0.3,
            generated=kv_slots(None, 3 * WINDOW),  # NoPE changes no cache
            **BOTH,
        ),
    ]
)


class TestTransformers(Comparison, GreedyText):
    """Logits unsharded and on 2x2, the export, greedy text on 1x1 and 1x2 (tests/hf_harness.py)."""


@pytest.mark.parametrize("family", ["smollm3"], indirect=True)
def test_a_rotated_nope_layer_fails_the_transformers_comparison(family, monkeypatch):
    """The NoPE layer rotated as the others (``global_nope`` dropped from the kind tables), in code both
    verify's runs would share: only transformers' logits see it."""
    tables = attention.kind_tables
    monkeypatch.setattr(attention, "kind_tables", lambda c: tables(c.replace(global_nope=False)))
    assert drift(family) > 100 * RTOL


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
