"""Gemma 2's soft-capping (``attn_softcap``, ``final_softcap``: c * tanh(x / c) on the attention scores
and on the output logits), in every attention: plain, the blockwise kernel (forward, and its backward's
d tanh) and each --cp strategy; equal to the hand-written reference, proven sharded == unsharded in
float64 with its controls detected, refused in one line where it cannot be expressed (an export to a
family without it, a family without attention)."""

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
    with pytest.raises(ConfigError, match="attn_softcap=0.0001 needs a family with attention"):
        get_config("tiny").replace(attn_softcap=1e-4)
    from meshlm.io import hf_config

    with pytest.raises(ConfigError, match="attn_softcap=0.0001: transformers' gemma has no soft-capping"):
        hf_config.config_to_hf(cfg)
    with pytest.raises(ConfigError, match="final_softcap=0.05: transformers' gemma"):
        hf_config.config_to_hf(cfg.replace(attn_softcap=0.0))
    saved = cfg.to_dict()
    del saved["attn_softcap"], saved["final_softcap"]  # a checkpoint written before the fields
    from meshlm.model.config import from_dict

    assert from_dict(saved) == get_config("tiny-gemma")


def test_the_kernel_and_the_ring_cap_as_plain_attention_in_float64():
    """The kernel in the ring's chunked form (two K/V chunks, ragged blocks; blockwise attention is its
    one-chunk case): loss and q/k/v gradients equal plain attention's with the cap where tanh is
    neither linear nor saturated (and the cap matters)."""
    from meshlm.model.attention import _attend
    from meshlm.model.blockwise import chunked_attention

    with jax.enable_x64(True):
        r = np.random.default_rng(0)
        q, k, v = (jnp.asarray(r.normal(size=s)) for s in [(1, 12, 4, 8), (1, 12, 2, 8), (1, 12, 2, 8)])
        pos = jnp.arange(12)[None]
        split = lambda x: [x[:, :7], x[:, 7:]]
        runs = {
            "plain": lambda q, k, v, cap: _attend(q, k, v, pos, pos, softcap=cap),
            "ring": lambda q, k, v, cap: chunked_attention(
                q, split(k), split(v), pos, split(pos), block=4, softcap=cap
            ),
        }
        loss = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v, 0.7)))
        # jitted: each one program, as the model runs it (not one per operation)
        grads = {name: jax.jit(jax.value_and_grad(loss(f), (0, 1, 2)))(q, k, v) for name, f in runs.items()}
        uncapped = float(jnp.sum(jnp.sin(jax.jit(lambda *a: runs["plain"](*a, 0.0))(q, k, v))))
        grads = jax.tree.map(np.asarray, grads)
    (want, want_grads) = grads.pop("plain")
    assert want.dtype == np.float64 and abs(uncapped - want) > 1e-2
    for got, got_grads in grads.values():
        assert abs(got - want) <= 1e-12 * abs(want)
        for a, b in zip(got_grads, want_grads, strict=True):
            assert np.max(np.abs(a - b)) <= 1e-12 * np.max(np.abs(b))


KERNEL_CONTROLS = (
    "soft-cap applied after the softmax",
    "soft-cap not applied in the backward",
    "cap missing on the ring's remote blocks",
)


# slow: the capped model's proof under the ring (its cost); the cap in the kernel and the ring:
# test_the_kernel_and_the_ring_cap_as_plain_attention_in_float64, the capped proof on 2x2, both quick
@pytest.mark.slow
def test_softcap_proven_blockwise_under_the_cp_ring_with_its_controls_detected():
    """tiny-gemma-softcap on a cp = 2 ring of blockwise attention, float64: sharded == unsharded (the
    plain [T, T] reference), each soft-cap fault of the kernel and the ring detected."""
    from meshlm.parallel.layout import Layout
    from meshlm.proof.cp_controls import CP_CONTROLS

    cfg = get_config("tiny-gemma-softcap").replace(attention="blockwise", attn_block=4, n_layers=1)
    controls = tuple(c for c in CONTROLS + CP_CONTROLS if c.name in KERNEL_CONTROLS)
    with jax.enable_x64(True):
        problem = model_problem(cfg, "tiny-gemma-softcap", 1, 1, 16)
        report = verify(problem, Layout(cp=2), dtype=jnp.float64, controls=controls)
    assert report.ok, format_report(report)
    assert max(p.max_rel_err for p in report.params) <= 1e-12
    assert sorted(c["name"] for c in report.controls) == sorted(KERNEL_CONTROLS)
    assert all(c["detected"] for c in report.controls), report.controls
