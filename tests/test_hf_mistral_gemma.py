"""Mistral (sliding-window attention) and Gemma from transformers: a tiny random model of each (no
download) converts with logits equal to transformers' (float32, unsharded and on 2x2), `meshlm generate
--temperature 0` prints transformers' greedy text past the window, and the export loads back. The window
off by one is common to the sharded and unsharded runs, so only this comparison can catch it: shown."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_harness import Case, Comparison, GreedyText, drift, family_fixture  # noqa: E402
from hf_helpers import RTOL, TINY, rel  # noqa: E402

from meshlm.errors import ConfigError  # noqa: E402
from meshlm.generate.generator import logits_with_cache  # noqa: E402
from meshlm.io import hf_config  # noqa: E402
from meshlm.model import attention, transformer  # noqa: E402
from meshlm.model.params import unflatten  # noqa: E402

WINDOW = 4  # smaller than the prompt, the generation and the logits test's sequence (16 = 4 windows)
SMALL = dict(**TINY, num_hidden_layers=2, intermediate_size=64)


def _window_cache(out):
    """Mistral's every layer is windowed: the decode cache holds WINDOW positions, not the context."""
    assert out["kv_cache"]["slots"] == WINDOW


# Every parameter perturbed by 0.05 (Gemma's norm weights start at 0), so a wrong mapping of any shows
family = family_fixture(
    [
        Case(
            "mistral",
            "MistralForCausalLM",
            lambda: transformers.MistralConfig(sliding_window=WINDOW, rope_theta=500.0, **SMALL),
            reads=dict(sliding_window=WINDOW),
            norm_noise=0.05,
            generated=_window_cache,
        ),
        Case(
            "gemma",
            "GemmaForCausalLM",
            # head_dim not hidden_size / heads (Gemma-7b: 256 x 16 heads on d_model 3072)
            lambda: transformers.GemmaConfig(head_dim=16, **SMALL),
            reads=dict(sliding_window=0),
            norm_noise=0.05,
            sharded=("--mesh", "2x2"),
        ),
    ]
)


class TestTransformers(Comparison, GreedyText):
    """Logits unsharded and on 2x2, the export, greedy text past the window on 1x1 and on 1x2 (Mistral)
    or 2x2 (Gemma) (tests/hf_harness.py)."""


# Bugs in code the sharded and the unsharded model share: verify cannot see them, transformers can.
SHARED_BUGS = {
    # the window one key too wide: i - window <= j
    "mistral": (attention, "window_visible", lambda q, k, w: (k <= q) & (k >= q - w)),
    # the embeddings not scaled by sqrt(d_model)
    "gemma": (transformer, "embed_scale", lambda d: 1.0),
}


@pytest.mark.parametrize("family", list(SHARED_BUGS), indirect=True)
def test_a_bug_common_to_both_runs_fails_the_transformers_comparison(family, monkeypatch):
    monkeypatch.setattr(*SHARED_BUGS[family["case"].name])
    assert drift(family) > 100 * RTOL


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
def test_rolling_cache_holds_the_window_and_equals_transformers(family):
    """The decode cache holds WINDOW positions, not the 64-token context (generate --json's report is
    checked by the harness' 1x1 test), and teacher-forced cached logits through 4 windows equal
    transformers' logits."""
    from meshlm.generate.generator import Generator, cache_memory
    from meshlm.parallel.mesh import make_mesh

    cfg, flat = family["case"].load(family["hf"])
    gen = Generator(cfg, unflatten(flat), make_mesh(1, 1))
    assert gen.max_len > 4 * WINDOW and cache_memory(gen, 2)["slots"] == WINDOW
    lengths = np.array([1, WINDOW + 1])
    got = logits_with_cache(gen, family["tokens"], lengths)
    for b, n in enumerate(lengths):
        assert rel(got[b], family["logits"][b, n - 1 :]) <= RTOL
