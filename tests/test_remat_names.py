"""Named remat policies (issue 63.1c): --remat save_qkv_proj / save_qkv_mlp_in / save_qkv_attn save the
projections the layers name, change no value (the float64 proof), and a model without those layers
refuses them in one line. (The remat control, a recomputed path that changes values, is caught under
each: tests/test_reference.py.)"""

import haiku as hk
import jax
import jax.numpy as jnp
import pytest
from jax._src.ad_checkpoint import saved_residuals  # (jax.ad_checkpoint exports print_saved_residuals)

from meshlm.errors import ConfigError
from meshlm.model.config import get_config
from meshlm.model.transformer import loss_fn
from meshlm.parallel.context import Parallel
from meshlm.parallel.mesh import make_mesh
from meshlm.proof import model_problem, verify

CFG = get_config("tiny-llama")  # 2 layers, d_model 64, 8 query / 4 KV heads of 8, d_ff 128
L, B, T = CFG.n_layers, 2, 8
QKV = [(L, B, T, CFG.n_heads, CFG.dim_per_head), *[(L, B, T, CFG.kv_heads, CFG.dim_per_head)] * 2]
LAYER_INPUT = [(L, B, T, CFG.d_model)]  # what full remat keeps
ATTN_OUT = (L, B, T, CFG.n_heads, CFG.dim_per_head)  # the attention's result: q's shape, counted apart
SAVED = {
    "save_qkv_proj": [*QKV],
    "save_qkv_mlp_in": [*QKV, *[(L, B, T, CFG.d_ff)] * 2],  # gate and up
    "save_qkv_attn": [*QKV, ATTN_OUT],
}


def _layer_residuals(cfg) -> list[tuple]:
    """The shapes of what the backward keeps of the layer loop (the scan's stacked residuals), sorted:
    each one counted (the attention's result has q's shape)."""
    f = hk.without_apply_rng(hk.transform(loss_fn(cfg, Parallel())))
    batch = {k: jnp.ones((B, T), jnp.int32) for k in ("inputs", "targets")}
    params = jax.jit(f.init)(jax.random.PRNGKey(0), batch)
    found = saved_residuals(f.apply, params, batch)
    return sorted(tuple(a.shape) for a, why in found if "output of scan" in why and a.ndim > 3)  # [L, ...]


# save_qkv_proj slow: the same mechanism with one name fewer (save_qkv_mlp_in's case is quick)
@pytest.mark.parametrize(
    "remat", [pytest.param("save_qkv_proj", marks=pytest.mark.slow), "save_qkv_mlp_in", "save_qkv_attn"]
)
def test_a_named_policy_saves_its_names_and_changes_no_value(remat):
    cfg = CFG.replace(remat=remat, unroll=1)
    assert _layer_residuals(cfg) == sorted(LAYER_INPUT + SAVED[remat])
    assert _layer_residuals(cfg.replace(remat="full")) == LAYER_INPUT
    with jax.enable_x64(True):
        report = verify(model_problem(cfg, remat, 2, 4, 16), make_mesh(2, 2), dtype=jnp.float64, controls=())
    assert report.ok and max(p.max_rel_err for p in report.params) <= 1e-12


def test_a_model_without_the_named_layers_refuses_them():
    with pytest.raises(ConfigError, match="has mixture-of-experts layers: use none, full or selective"):
        get_config("tiny-mixtral").replace(remat="save_qkv_proj")


def test_save_qkv_attn_keeps_the_flash_kernels_residuals():
    """Under flash attention the saved result is the kernel's own backward residuals, its output
    [B, h, Tp, E] (the sequence padded to the kernel's 128) and log-sum-exp [B, h, Tp], so the backward
    does not run the kernel's forward again (``flash_kernel._bridge_fwd``)."""
    cfg = CFG.replace(remat="save_qkv_attn", unroll=1, attention="flash")
    h, e, tp = CFG.n_heads, CFG.dim_per_head, 128
    kernel = [(L, B, h, tp), (L, B, h, tp, e)]
    assert _layer_residuals(cfg) == sorted(LAYER_INPUT + QKV + kernel)
