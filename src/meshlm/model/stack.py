"""The layer stack: n_layers copies of one layer with stacked parameters [L, ...] (``haiku``'s
layer_stack: a scan, so compile time does not grow with depth), and its per-layer inputs."""

from __future__ import annotations

import haiku as hk
import jax.numpy as jnp

import meshlm.model.attention as attention
from meshlm.model.config import ModelConfig
from meshlm.model.kv_kinds import kinds_stack
from meshlm.model.memory import remat_body


def stack_layers(cfg: ModelConfig, layer, x, positions, cache, starts=None):
    """Apply n_layers copies of ``layer`` with stacked parameters [L, ...] (flat compile time). The
    per-layer inputs: the KV cache (generation) and each layer's kind (Gemma 2/3's local and global
    layers, ``attention.layer_kinds``): traced values, so the parameters stay uniform."""
    if cfg.arch.moe:
        return _moe_stack(cfg, layer, x, positions, cache, starts)
    kinds = attention.layer_kinds(cfg)
    body = remat_body(cfg.remat, lambda x, c, k: layer(x, positions, c, starts, k))
    if cache is None and kinds is None:
        stack = hk.experimental.layer_stack(cfg.n_layers, unroll=cfg.layer_unroll, name="layers")
        stacked = stack(lambda x: body(x, None, None)[0])
        return stacked(x), None
    stacked = hk.experimental.layer_stack(
        cfg.n_layers, with_per_layer_inputs=True, unroll=cfg.layer_unroll, name="layers"
    )
    if kinds is None:
        return stacked(lambda x, c: body(x, c, None))(x, cache)
    kinds = jnp.asarray(kinds)
    if cache is None:
        return stacked(lambda x, k: (body(x, None, k)[0], None))(x, kinds)[0], None
    if "k_local" in cache:  # local and global layers' caches apart (``kv_kinds``): in the carry
        return kinds_stack(cfg, stacked, body, x, cache)
    return stacked(body)(x, cache, kinds)


def _moe_stack(cfg: ModelConfig, layer, x, positions, cache, starts=None):
    """``stack_layers`` of mixture-of-experts layers -> (x, cache, routing statistics [L, 2E + 3]): each
    layer's statistics leave the stack as its per-layer output (``model.moe``)."""

    def step(x, c):
        y, c, stats = layer(x, positions, c, starts)
        return y, (c, stats)

    body = remat_body(cfg.remat, step)
    stacked = hk.experimental.layer_stack(
        cfg.n_layers, with_per_layer_inputs=True, unroll=cfg.layer_unroll, name="layers"
    )
    x, (cache, stats) = stacked(body)(x, cache)
    return x, cache, stats
