"""Gemma 4's layer stack when its global layers have an attention shape of their own (transformers'
``global_head_dim``, ``num_global_key_value_heads``: ``PerLayerFields.global_shape``).

Two parameter stacks (``layer_kinds.stacks``): "layers" the local layers' [L_local, ...], "global_layers"
the global layers' [L_global, ...], whose attention computes with the global view of the config
(``PerLayerFields.global_view``: its head width E_g and KV heads K_g, so its projections, q/k norms and
rotary, proportional RoPE included, are of that width). The stack runs as consecutive runs of one kind
(``layer_kinds.runs``), one scan each over its slice of its stack; a run's kind is a Python constant, so
each layer computes one attention shape (no ``lax.cond`` between shapes). The carry: x [B, T, D], each
kind's shared keys and values apart ({"k", "v": [1, B, T, Kl, E]} local, [1, B, T, Kl_g, E_g] global,
per shard: ``per_layer._shared_init``) and in generation the two-array cache (``kv_kinds``: its local
and global arrays are apart already, each of its kind's shape). Per-layer inputs, the reuse flags and
the cache indices are the uniform stack's (``per_layer.stack``), sliced by run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from meshlm.model import per_layer
from meshlm.model.layer_kinds import GLOBAL_STACK, runs, stacks
from meshlm.model.memory import remat_body
from meshlm.model.stack import _stacked

KIND = {GLOBAL_STACK: 1}  # a stack's layer kind (1 global); the other stack's: 0, local


def split_stack(cfg, par, make_layer, x, positions, cache, starts, ple):
    """``per_layer.stack`` with the two stacks -> (x, cache)."""
    if cache is not None and "k_local" not in cache:
        raise ValueError("global layers of their own shape keep the two-array cache (kv_kinds)")
    views = {name: cfg.global_view() if KIND.get(name) else cfg for name in stacks(cfg)}
    ple = None if ple is None else per_layer.in_layer_order(ple)
    shared = None
    if cfg.kv_shared_layers:  # (local, global): each kind's own keys and values
        shared = tuple(per_layer._shared_init(views[name], par, x, 1) for name in sorted(views, key=_kind))
    params, apply = {}, {}
    for name, indices in stacks(cfg).items():
        kind = _kind(name)
        body = remat_body(cfg.remat, _body(make_layer(views[name]), positions, starts, kind))
        one = {"reuse": jnp.asarray(False), "ple": None if ple is None else ple[indices[0]]}
        example = (None if shared is None else shared[kind], None, one)
        params[name], apply[name] = _stacked(name, len(indices), body, x, example)
    reuse = jnp.asarray(np.arange(cfg.n_layers) >= cfg.first_shared)
    index = None if cache is None else jnp.asarray(per_layer.cache_index(cfg))
    for name, first, start, stop in runs(cfg):
        own, count = slice(first, first + stop - start), stop - start
        p = jax.tree.map(lambda a, s=slice(start, stop): a[s], params[name])
        xs = {"reuse": reuse[own], "ple": None if ple is None else ple[own]}
        xs["index"] = None if index is None else index[own]
        step = _step(apply[name], _kind(name))
        unroll = min(cfg.layer_unroll, count)
        (x, shared, cache), _ = lax.scan(step, (x, shared, cache), (p, xs), unroll=unroll)
    return x, cache


def _kind(name: str) -> int:
    return KIND.get(name, 0)


def _body(layer, positions, starts, kind: int):
    """A layer as (x, (its kind's shared keys and values, cache, {"reuse", "ple"})) -> (x, shared, cache),
    its kind the constant ``kind`` and its slot of ``shared`` 0 (each kind's carry is its own)."""

    def body(x, extra):
        shared, cache, one = extra
        return layer(x, shared, positions, cache, starts, {**one, "kind": kind, "slot": 0})

    return body


def _step(apply, kind: int):
    """One layer of a run's scan: ((x, shared by kind, cache), (its parameters, its inputs)) -> the carry."""

    def step(carry, pxs):
        (x, shared, cache), (p, xs) = carry, pxs
        c = None if cache is None else {**cache, "index": xs["index"]}
        own = None if shared is None else shared[kind]
        x, own, c = apply(p, None, x, (own, c, {"reuse": xs["reuse"], "ple": xs["ple"]}))
        if shared is not None:
            shared = tuple(own if i == kind else s for i, s in enumerate(shared))
        return (x, shared, None if cache is None else {name: c[name] for name in cache}), None

    return step
