"""Gemma 2's soft-capping (``attn_softcap``, ``final_softcap``: c * tanh(x / c) on the attention scores
and on the output logits), in plain attention: equal to the hand-written reference, proven sharded ==
unsharded in float64 with its controls detected, refused in one line where it is not implemented
(blockwise attention, --cp, an export to a family without it)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm.errors import ConfigError
from meshlm.model.attention import soft_cap
from meshlm.model.config import get_config
from meshlm.parallel.mesh import make_mesh
from meshlm.proof import format_report
from meshlm.proof.controls import CONTROLS
from meshlm.proof.problem import model_problem
from meshlm.proof.prover import verify

# Caps below the tiny model's attention scores and logits at initialisation: tanh is far from the
# identity there, so each cap matters in the float64 proof (test_controls_margin.py holds the controls
# to 100x float32's tolerance on larger scores).
CAPS = dict(attn_softcap=1e-4, final_softcap=0.05)
SOFTCAP_CONTROLS = ("attention soft-cap off", "final-logit soft-cap off")


def test_soft_cap_is_transformers_formula():
    x = np.linspace(-50, 50, 11)
    assert np.allclose(soft_cap(jnp.asarray(x), 20.0), np.tanh(x / 20.0) * 20.0, rtol=1e-6)
    assert soft_cap(x, 0.0) is x


def test_softcapped_gemma_proven_on_2x2_in_float64():
    cfg = get_config("tiny-gemma").replace(**CAPS)
    controls = tuple(c for c in CONTROLS if c.name in SOFTCAP_CONTROLS)
    with jax.enable_x64(True):
        problem = model_problem(cfg, "tiny-gemma softcap", 2, 4, 16, dp=2)
        report = verify(problem, make_mesh(2, 2), dtype=jnp.float64, controls=controls)
    assert report.ok, format_report(report)
    assert max(p.max_rel_err for p in report.params) <= 1e-12
    assert [c["name"] for c in report.controls] == list(SOFTCAP_CONTROLS)
    assert all(c["detected"] for c in report.controls), report.controls


def test_softcap_refusals():
    cfg = get_config("tiny-gemma").replace(**CAPS)
    with pytest.raises(ConfigError, match="attn_softcap=0.0001 needs .*attention='plain'"):
        cfg.replace(attention="blockwise")
    from meshlm.io import hf_config

    with pytest.raises(ConfigError, match="attn_softcap=0.0001: transformers' gemma has no soft-capping"):
        hf_config.config_to_hf(cfg)
    with pytest.raises(ConfigError, match="final_softcap=0.05: transformers' gemma"):
        hf_config.config_to_hf(cfg.replace(attn_softcap=0.0))
    saved = cfg.to_dict()
    del saved["attn_softcap"], saved["final_softcap"]  # a checkpoint written before the fields
    from meshlm.model.config import from_dict

    assert from_dict(saved) == get_config("tiny-gemma")


def test_softcap_refused_under_cp():
    import haiku as hk

    from meshlm.model.transformer import local_logits
    from meshlm.parallel.context import Parallel
    from meshlm.parallel.layout import Layout

    cfg = get_config("tiny-gemma").replace(**CAPS)
    par = Parallel(layout=Layout(cp=2), sharded=True)
    forward = hk.transform(lambda tokens: local_logits(cfg, par, tokens))
    with pytest.raises(ConfigError, match="--cp does not support attention soft-capping yet"):
        forward.init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))
