"""The layer stack: n_layers copies of one layer with stacked parameters [L, ...] (``haiku``'s
layer_stack: a scan, so compile time does not grow with depth), and its per-layer inputs."""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import meshlm.model.attention as attention
from meshlm.model import lora_dropout
from meshlm.model.config import ModelConfig
from meshlm.model.kv_kinds import LOCAL_KEYS, carried_stack, kind_index
from meshlm.model.layer_kinds import DENSE_STACK, LINEAR_STACK, MOE_STACK, runs, stacks
from meshlm.model.layer_loop import layer_loop, layer_stack
from meshlm.model.linear_cache import LINEAR_KEYS
from meshlm.model.memory import remat_body


def stack_layers(cfg: ModelConfig, layer, x, positions, cache, starts=None, others=None, gathers=True):
    """Apply n_layers copies of ``layer`` with stacked parameters [L, ...] (flat compile time). The
    per-layer inputs: each layer's kind (Gemma 2/3's local and global layers,
    ``attention.layer_kinds``), traced values, so the parameters stay uniform; the KV cache
    (generation) rides in the carry, each layer writing its new tokens in place (``carried_stack``).
    Layers of a second kind with parameters of their own (``layer_kinds.stacks``: a mixture of experts' dense
    layers, a hybrid's linear-attention layers) run ``others[stack name]`` (x -> (x, cache)) at their
    indices (``_mixed_stack``). ``gathers``: whether a layer all-gathers inside (``memory.remat_body``)."""
    if others:
        return _mixed_stack(cfg, {MOE_STACK: layer, **others}, x, positions, cache, starts, gathers)
    if cfg.arch.moe:
        return _moe_stack(cfg, layer, x, positions, cache, starts, gathers)
    # --lora-dropout in a train step: each layer's index beside its kind (its dropout mask's)
    layer, kinds = lora_dropout.indexed(layer, attention.layer_kinds(cfg), cfg.n_layers)
    body = remat_body(cfg.remat, lambda x, c, k: layer(x, positions, c, starts, k), gathers)
    if cache is None and kinds is None:
        stack = layer_stack(cfg.n_layers, unroll=cfg.layer_unroll, name="layers")
        stacked = stack(lambda x: body(x, None, None)[0])
        return stacked(x), None
    stacked = layer_stack(cfg.n_layers, with_per_layer_inputs=True, unroll=cfg.layer_unroll, name="layers")
    if cache is not None:  # the stacked cache in the carry, written in place (``carried_stack``)
        return carried_stack(cfg, stacked, body, x, cache, kinds)
    kinds = jax.tree.map(jnp.asarray, kinds)
    return stacked(lambda x, k: (body(x, None, k)[0], None))(x, kinds)[0], None


def _moe_stack(cfg: ModelConfig, layer, x, positions, cache, starts=None, gathers=True):
    """``stack_layers`` of mixture-of-experts layers -> (x, cache, routing statistics [L, 2E + 3]): each
    layer's statistics leave the stack as its per-layer output (``model.moe``); with layer kinds
    (gpt-oss's windowed and full layers) each layer's kind is a per-layer input, as in a dense stack."""

    def step(x, c, kind=None):
        y, c, stats = layer(x, positions, c, starts, kind)
        return y, (c, stats)

    body = remat_body(cfg.remat, step, gathers)
    stacked = layer_stack(cfg.n_layers, with_per_layer_inputs=True, unroll=cfg.layer_unroll, name="layers")
    kinds = attention.layer_kinds(cfg)
    if cache is not None:  # the stacked cache in the carry, written in place (``carried_stack``)
        return carried_stack(cfg, stacked, body, x, cache, kinds, stats=True)
    if kinds is None:
        x, (cache, stats) = stacked(body)(x, cache)
    else:
        x, (cache, stats) = stacked(body)(x, cache, jnp.asarray(kinds))
    return x, cache, stats


def _mixed_stack(cfg: ModelConfig, layers: dict, x, positions, cache, starts=None, gathers=True):
    """``stack_layers`` of a model with layers of two kinds -> (x, cache), and with a mixture of experts
    the statistics of its MoE layers [L_moe, ``moe.stats_size``], in layer order (dense layers have no
    routing). Each kind's parameters stack apart (``layer_kinds.stacks``: [count, ...] under "layers"
    and "dense_layers" or "linear_layers"), and the stack runs as consecutive runs of same-kind
    layers, one scan each over its slice of them; the attention layers' cache [L, ...] (with local and
    global layers, ``kv_kinds``: Llama 4's chunked ones, its two arrays) rides in the carry, a
    hybrid's linear layers' arrays are sliced into their runs and rejoined (``_cache_index``)."""
    bodies = {name: _three(layer, positions, starts) for name, layer in layers.items()}
    kinds, params, apply = attention.layer_kinds(cfg), {}, {}
    for name, indices in stacks(cfg).items():
        params[name], apply[name] = _stacked(
            name, len(indices), remat_body(cfg.remat, bodies[name], gathers), x
        )
    parts, stats = {}, []
    # the attention layers' cache rides in the carry, written in place (``carried_stack``); a hybrid's
    # linear layers' arrays (each step rewrites them whole) are sliced into their runs and rejoined
    carried = None if cache is None else {k: a for k, a in cache.items() if k not in LINEAR_KEYS}
    for name, first, start, stop in runs(cfg):
        p = jax.tree.map(lambda a, s=slice(start, stop): a[s], params[name])
        own, unroll = slice(first, first + stop - start), min(cfg.layer_unroll, stop - start)  # its layers
        kind = None if kinds is None else jnp.asarray(kinds[own])  # Llama 4's chunked and NoPE layers
        if carried is not None and name != LINEAR_STACK:  # each layer writes its slice of the arrays
            index = jnp.asarray(_cache_index(cfg, cache, own, start, stop), jnp.int32)
            (x, carried), st = layer_loop(_carried_step(apply[name]), (x, carried), (p, kind, index), unroll)
        else:
            c = None if cache is None else {key: cache[key][start:stop] for key in LINEAR_KEYS}
            x, (c, st) = layer_loop(_step(apply[name]), x, (p, c, kind), unroll)
            for key, part in (c or {}).items():
                parts.setdefault(key, []).append(part)
        if st is not None:
            stats.append(st)
    if cache is not None:
        cache = {**carried, **{key: jnp.concatenate(part) for key, part in parts.items()}}
    return (x, cache, jnp.concatenate(stats)) if cfg.arch.moe else (x, cache)


def _cache_index(cfg: ModelConfig, cache: dict, own: slice, start: int, stop: int) -> np.ndarray:
    """A run's layers' slices of the carried cache: with local and global layers (``kv_kinds``) each
    one's index among its kind's; a hybrid's attention layers ("k", "v" [L_full, ...] beside
    ``linear_cache.LINEAR_KEYS``) ``[start, stop)``, in their own order; any other cache's layers
    theirs (``own``), in layer order."""
    if LOCAL_KEYS[0] in cache:
        return kind_index(cfg)[own]
    if LINEAR_KEYS[0] in cache:
        return np.arange(start, stop)
    return np.arange(cfg.n_layers)[own]


def _three(layer, positions, starts):
    """A layer as (x, cache, its kind or None) -> (x, cache, its routing statistics or None)."""

    def body(x, c, kind=None):
        out = layer(x, positions, c, starts) if kind is None else layer(x, positions, c, starts, kind)
        return out if len(out) == 3 else (*out, None)

    return body


def _step(apply):
    """One layer of a run's scan: (x, (its parameters, its cache)) -> (x, (cache, statistics))."""

    def step(x, pc):
        y, c, st = apply(pc[0], None, x, pc[1], pc[2])
        return y, (c, st)

    return step


def _carried_step(apply):
    """One layer of a run's scan with the two-array cache in the carry: ((x, cache), (its parameters,
    kind, index among its kind's layers)) -> ((x, new cache), statistics)."""

    def step(carry, pki):
        (x, stacks), (p, kind, index) = carry, pki
        y, c, st = apply(p, None, x, {**stacks, "index": index}, kind)
        return (y, {name: c[name] for name in stacks}), st

    return step


def _stacked(name: str, count: int, body, x, example=None):
    """The parameters [count, ...] of ``count`` layers ``body`` (x, cache) -> (x, cache, stats) under the
    module ``name``, made as ``hk.experimental.layer_stack`` makes them (each layer initialised on the
    previous one's output, its own key), and the layer's pure apply function. ``example``: the second
    argument ``body`` is initialised with (None: no cache)."""
    init_fn, apply_fn = hk.transform(body)

    def scanned_init(x, rng):
        def one(carry, _):
            x, rng = carry
            rng, next_rng, apply_rng = jax.random.split(rng, 3) if rng is not None else (None,) * 3
            p = init_fn(rng, x, example)
            return (apply_fn(p, apply_rng, x, example)[0], next_rng), p

        return lax.scan(one, (x, rng), None, length=count)[1]

    return hk.lift(scanned_init, name=name, allow_reuse=True)(x, hk.maybe_next_rng_key()), apply_fn


def dense_prefix(cfg: ModelConfig, layer, x, positions, starts, count: int, gathers=True):
    """A mixture of experts' first ``count`` layers, all dense (``stage_layers.prefix``: run with the
    embedding on the pipeline's first stage), as ``_mixed_stack`` runs them: one scan over the
    "dense_layers" stack [count, ...] (the same parameters), each layer with its kind where the model
    has kinds."""
    kinds = attention.layer_kinds(cfg)
    body = remat_body(cfg.remat, _three(layer, positions, starts), gathers)
    params, apply = _stacked(DENSE_STACK, count, body, x)
    kind = None if kinds is None else jnp.asarray(kinds[:count])
    return layer_loop(_step(apply), x, (params, None, kind), min(cfg.layer_unroll, count))[0]
