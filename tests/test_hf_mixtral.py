"""Mixtral from transformers: a tiny random MixtralForCausalLM (no download; every weight perturbed, the
norm weights away from 1) converts with logits equal to transformers' (float32, unsharded and on 2x2),
from both weight layouts (per-expert tensors, as save_pretrained writes, and transformers 5's fused
``gate_up_proj`` / ``down_proj``); `meshlm generate --temperature 0` prints transformers' greedy text on
1x1, 1x2 and 2x1 with --ep 2; the export loads back with equal logits; the "hf" load-balancing loss is
transformers'."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_harness import Case, Comparison, GreedyText, family_fixture  # noqa: E402
from hf_helpers import ROPE, TINY, balance_loss_equal_transformers  # noqa: E402

from meshlm.errors import ConfigError  # noqa: E402
from meshlm.io import hf_config  # noqa: E402
from meshlm.model.config import get_config  # noqa: E402

MIXTRAL = dict(**TINY, num_hidden_layers=2, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)
MIXTRAL |= dict(rope_parameters=ROPE, router_aux_loss_coef=0.02)
family = family_fixture(
    [
        Case(
            "mixtral",
            "MixtralForCausalLM",
            lambda: transformers.MixtralConfig(**MIXTRAL),
            reads=dict(n_experts=4, router_aux_loss_coef=0.02),
            fused=True,
            sharded=("--mesh", "2x1", "--ep", "2"),
        )
    ]
)


class TestTransformers(Comparison, GreedyText):
    """Logits unsharded and on 2x2 (and the fused tensors read bitwise the same), the export, greedy text
    on 1x1 and 2x1 with --ep 2 (tests/hf_harness.py)."""


def test_hf_balance_loss_is_transformers(family):
    """Our "hf" balance loss of the model's own routing = transformers' load_balancing_loss_func of its
    router logits (every layer's tokens pooled: ~k when balanced)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    balance_loss_equal_transformers(family["hf"], family["model"], family["tokens"], load_balancing_loss_func)


def test_unsupported_mixtral_config():
    base = hf_config.config_to_hf(get_config("tiny-mixtral").replace(router_z_loss_coef=0.0))
    with pytest.raises(ConfigError, match="router_jitter_noise"):
        hf_config.config_from_hf({**base, "router_jitter_noise": 0.1})


@pytest.mark.parametrize("preset", ["mixtral-8x7b", "mixtral-8x22b"])
def test_preset_config_round_trip(preset):
    cfg = get_config(preset)
    assert hf_config.config_from_hf(hf_config.config_to_hf(cfg)) == cfg
