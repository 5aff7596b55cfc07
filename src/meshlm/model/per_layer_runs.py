"""Gemma 4's layer stack when its global layers have an attention shape of their own (transformers'
``global_head_dim``, ``num_global_key_value_heads``: ``PerLayerFields.global_shape``).

Two parameter stacks (``layer_kinds.stacks``): "layers" the local layers' [L_local, ...], "global_layers"
the global layers' [L_global, ...], whose attention computes with the global view of the config
(``PerLayerFields.global_view``: its head width E_g and KV heads K_g, so its projections, q/k norms and
rotary, proportional RoPE included, are of that width). The stack runs as whole periods of
``global_every`` layers, one scan over them (each a scan over its local layers, then its global layer),
and any local layers after the last global one as a run (``layer_kinds.runs``); a layer's kind is a
Python constant, so each computes one attention shape (no ``lax.cond`` between shapes). The carry: x [B,
T, D], each kind's shared keys and values apart ({"k", "v": [1, B, T, Kl, E]} local, [1, B, T, Kl_g, E_g]
global, per shard: ``per_layer._shared_init``) and in generation the two-array cache (``kv_kinds``: its
local and global arrays are apart already, each of its kind's shape). Per-layer inputs, the reuse flags
and the cache indices are the uniform stack's (``per_layer.stack``), sliced by run."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import meshlm.model.attention as attention
from meshlm.model import per_layer
from meshlm.model.layer_kinds import GLOBAL_STACK, runs, stacks
from meshlm.model.layer_loop import layer_loop
from meshlm.model.memory import layer_gathers, remat_body
from meshlm.model.stack import _stacked

KIND = {GLOBAL_STACK: 1}  # a stack's layer kind (1 global); the other stack's: 0, local


def split_stack(cfg, par, make_layer, x, positions, cache, starts, ple):
    """``per_layer.stack`` with the two stacks -> (x, cache, routing statistics [L, 2E + 3] in layer
    order, or None without experts)."""
    if cache is not None and "k_local" not in cache:
        raise ValueError("global layers of their own shape keep the two-array cache (kv_kinds)")
    views = {name: cfg.global_view() if KIND.get(name) else cfg for name in stacks(cfg)}
    ple = None if ple is None else per_layer.in_layer_order(ple)
    shared = None
    if cfg.kv_shared_layers:  # (local, global): each kind's own keys and values
        shared = tuple(per_layer._shared_init(views[name], par, x, 1) for name in sorted(views, key=_kind))
    params, apply, kinds = {}, {}, attention.layer_kinds(cfg)  # the kind each layer attends as
    for name, indices in stacks(cfg).items():
        attends = int(kinds[indices[0]])  # its stack's kind (the proof's kinds-swapped control: the other)
        body = remat_body(
            cfg.remat, _body(make_layer(views[name]), positions, starts, attends), layer_gathers(par)
        )
        one = {"reuse": jnp.asarray(False), "ple": None if ple is None else ple[indices[0]]}
        example = (None if shared is None else shared[_kind(name)], None, one)
        params[name], apply[name] = _stacked(name, len(indices), body, x, example)
    xs = {"reuse": jnp.asarray(np.arange(cfg.n_layers) >= cfg.first_shared), "ple": ple}
    xs["index"] = None if cache is None else jnp.asarray(per_layer.cache_index(cfg))
    carry, covered, stats = _periods(cfg, params, apply, xs, (x, shared, cache))
    for name, first, start, stop in runs(cfg):  # the local layers after the last global one
        if first < covered:
            continue
        own, count = slice(first, first + stop - start), stop - start
        p = jax.tree.map(lambda a, s=slice(start, stop): a[s], params[name])
        step = _step(apply[name], _kind(name))
        unroll = min(cfg.layer_unroll, count)
        carry, more = layer_loop(step, carry, (p, jax.tree.map(lambda a, s=own: a[s], xs)), unroll, count)
        stats = None if more is None else jnp.concatenate([a for a in (stats, more) if a is not None])
    return carry[0], carry[2], stats


def _periods(cfg, params, apply, xs, carry):
    """The whole periods of ``global_every`` layers (every - 1 local ones, then a global one) as one
    scan over the periods, each a scan over its local layers and its global layer: two layer bodies
    traced, however deep the model (a scan per run would trace one per run). -> (carry, layers run,
    their routing statistics [layers run, 2E + 3] in layer order, or None)."""
    every = cfg.global_every
    periods = cfg.n_layers // every
    if not periods:
        return carry, 0, None
    local, full = (name for name in sorted(params, key=_kind))
    cut = lambda a, n, per: a[: n * per].reshape(n, per, *a.shape[1:])
    pl = jax.tree.map(lambda a: cut(a, periods, every - 1), params[local])
    pg = jax.tree.map(lambda a: a[:periods], params[full])
    per = jax.tree.map(lambda a: cut(a, periods, every), xs)
    inner = min(cfg.layer_unroll, every - 1)

    def period(carry, one):
        p_local, p_global, xs = one
        head, tail = jax.tree.map(lambda a: a[: every - 1], xs), jax.tree.map(lambda a: a[every - 1], xs)
        carry, first = layer_loop(_step(apply[local], 0), carry, (p_local, head), inner, every - 1)
        carry, last = _step(apply[full], 1)(carry, (p_global, tail))
        return carry, None if last is None else jnp.concatenate([first, last[None]])

    outer = max(1, min(periods, cfg.layer_unroll // every))
    carry, stats = layer_loop(period, carry, (pl, pg, per), outer, periods)
    return carry, periods * every, None if stats is None else stats.reshape(-1, stats.shape[-1])


def _kind(name: str) -> int:
    return KIND.get(name, 0)


def _body(layer, positions, starts, kind: int):
    """A layer as (x, (its kind's shared keys and values, cache, {"reuse", "ple"})) -> (x, shared, cache,
    stats), its kind the constant ``kind`` and its slot of ``shared`` 0 (each kind's carry is its own)."""

    def body(x, extra):
        shared, cache, one = extra
        return layer(x, shared, positions, cache, starts, {**one, "kind": kind, "slot": 0})

    return body


def _step(apply, kind: int):
    """One layer of a run's scan: ((x, shared by kind, cache), (its parameters, its inputs)) -> (the
    carry, its routing statistics or None)."""

    def step(carry, pxs):
        (x, shared, cache), (p, xs) = carry, pxs
        c = None if cache is None else {**cache, "index": xs["index"]}
        own = None if shared is None else shared[kind]
        x, own, c, stats = apply(p, None, x, (own, c, {"reuse": xs["reuse"], "ple": xs["ple"]}))
        if shared is not None:
            shared = tuple(own if i == kind else s for i, s in enumerate(shared))
        return (x, shared, None if cache is None else {name: c[name] for name in cache}), stats

    return step
