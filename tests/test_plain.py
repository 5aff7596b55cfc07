"""The hand-written ``plain`` reference of bench computes meshlm's model; unrolling the layer loop changes
nothing but rounding; the step's ``healthy`` flag keeps the state after a non-finite step. Each model is
compared jitted, as bench and the step run it (one program each, not one per operation)."""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm.errors import ConfigError
from meshlm.model.config import get_config
from meshlm.model.transformer import loss_fn
from meshlm.parallel.context import Parallel
from meshlm.perf import plain
from meshlm.train.config import TrainConfig
from meshlm.train.optim import OptimConfig, adamw, make_step

CASES = {  # every family, grouped-query attention, tied embeddings, z-loss, partial rotary
    "tiny-llama": {},
    "tiny-gqa": {"tie_embeddings": True, "z_loss": 1e-3},
    "tiny-gptj": {"z_loss": 1e-3},
    "seed": {},
    # GeGLU, RMSNorm times (1 + w), the embedding scale, head_dim != d_model / heads; and Mistral's
    # sliding window (any attention family's), inside the test's 16 positions
    "tiny-gemma": {"sliding_window": 5},
    "tiny-qwen3": {"attn_sinks": True},  # per-head q/k norm before rotary, head_dim != d_model / heads; sinks
    "tiny-olmo2": {},  # norms after each branch, the q/k norm over the whole projection
    "tiny-llama3": {"attn_softcap": 0.02, "final_softcap": 0.1},  # Gemma 2's soft-capping (tied head)
    # the sandwich block, local (window 8 < 16) and global layers with two rotary bases (the global
    # one scaled), the (1 + w) q/k norm, the attention scalar (Gemma 2's soft-caps: tiny-llama3's)
    "tiny-gemma3": {"n_layers": 3},  # one pattern: local, local, global
    # YaRN (frequencies and cos/sin scaled) on the full layers only, windows (8 < 16) on the others
    "tiny-olmo3": {
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}
    },
}


def _problem(name, **changes):
    cfg = get_config(name).replace(**changes)
    rng = np.random.default_rng(0)
    t = min(cfg.max_seq_len, 16)
    batch = {
        k: jnp.asarray(rng.integers(0, cfg.vocab_size, (2, t)), jnp.int32) for k in ("inputs", "targets")
    }
    params = jax.jit(hk.transform(loss_fn(cfg, Parallel())).init)(jax.random.PRNGKey(0), batch)
    return cfg, jax.tree.map(lambda p: p.astype(jnp.float64), params), batch


def _meshlm_loss(cfg):
    return hk.without_apply_rng(hk.transform(loss_fn(cfg, Parallel()))).apply


def _worst_rel(a, b) -> float:
    return max(
        float(jnp.max(jnp.abs(x - y)) / jnp.max(jnp.abs(x)))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


# The bench's yardstick models quick (tiny-llama: llama-100m's family; tiny-qwen3: the Qwen3 presets'),
# the other families' features slow (its scale: a matrix of families, each the same comparison)
QUICK = ("tiny-llama", "tiny-qwen3")


@pytest.mark.parametrize(
    "name", [n if n in QUICK else pytest.param(n, marks=pytest.mark.slow) for n in CASES]
)
def test_plain_equals_meshlm_in_float64(name):
    with jax.enable_x64(True):
        cfg, params, batch = _problem(name, **CASES[name])
        want, want_g = jax.jit(jax.value_and_grad(_meshlm_loss(cfg)))(params, batch)
        got, got_g = jax.jit(jax.value_and_grad(lambda p, b: plain.loss(cfg, p, b)))(params, batch)
        assert abs(float(got - want)) <= 1e-12 * abs(float(want))
        assert _worst_rel(want_g, got_g) <= 1e-12


def test_a_wrong_plain_model_is_caught():
    """The comparison can fail: plain without the causal mask differs from meshlm."""
    with jax.enable_x64(True):
        cfg, params, batch = _problem("tiny-llama")
        want = jax.jit(_meshlm_loss(cfg))(params, batch)
        orig = plain._attention
        try:
            plain._attention = lambda cfg, p, x, cos, sin, mask: orig(
                cfg, p, x, cos, sin, jnp.ones_like(mask)
            )
            got = jax.jit(lambda p, b: plain.loss(cfg, p, b))(params, batch)
        finally:
            plain._attention = orig
        assert abs(float(got - want)) > 1e-6


@pytest.mark.parametrize("unroll", [1, 2, 3])
def test_unroll_changes_only_rounding(unroll):
    with jax.enable_x64(True):
        cfg, params, batch = _problem("tiny-llama")
        assert cfg.unroll == 0 and cfg.layer_unroll == cfg.n_layers  # the default: every layer
        want, want_g = jax.jit(jax.value_and_grad(_meshlm_loss(cfg)))(params, batch)
        rolled = cfg.replace(unroll=unroll)
        got, got_g = jax.jit(jax.value_and_grad(_meshlm_loss(rolled)))(params, batch)
        assert abs(float(got - want)) <= 1e-12 * abs(float(want))
        assert _worst_rel(want_g, got_g) <= 1e-12


def test_unroll_range_is_checked():
    with pytest.raises(ConfigError, match="unroll"):
        get_config("tiny-llama").replace(unroll=-1)
    with pytest.raises(ConfigError, match="unroll"):
        TrainConfig(unroll=-2)


def test_unhealthy_previous_step_keeps_the_state():
    """``healthy`` False (a previous step was non-finite, read back a step late) keeps the state, as a
    non-finite step itself does, and says so in metrics["ok"]."""
    cfg, params, batch = _problem("tiny-llama")
    params = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    ocfg = OptimConfig(warmup_steps=0)
    opt = adamw(ocfg, params)
    grad = jax.value_and_grad(_meshlm_loss(cfg))
    step = jax.jit(make_step(grad, opt, ocfg))
    state = opt.init(params)
    new, _, ok = step(params, state, batch, jnp.bool_(True))
    assert bool(ok["ok"]) and _worst_rel(params, new) > 0
    kept, kept_state, bad = step(params, state, batch, jnp.bool_(False))
    assert not bool(bad["ok"]) and np.isfinite(float(bad["loss"]))
    jax.tree.map(np.testing.assert_array_equal, (kept, kept_state), (params, state))


def test_auto_unroll_rolls_the_loop_for_fsdp_and_remat():
    from meshlm.train.step import step_model

    cfg = get_config("tiny-llama")
    assert step_model(cfg, remat="none", unroll=0, fsdp=False).layer_unroll == cfg.n_layers
    assert step_model(cfg, remat="none", unroll=0, fsdp=True).layer_unroll == 1
    assert step_model(cfg, remat="selective", unroll=0, fsdp=False).layer_unroll == 1
    assert step_model(cfg, remat="full", unroll=2, fsdp=True).layer_unroll == 2  # explicit wins
