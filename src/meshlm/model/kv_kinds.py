"""The KV cache of a model whose layers mix local and full (global) attention: Gemma 2/3, gpt-oss and
OLMo 3 (windowed local layers), Llama 4 (chunked ones).

A local layer sees only its last ``sliding_window`` = W positions, or (chunked) the positions of its
chunk of W = ``attn_chunk``, never more than W back (``local_span``), so its decode cache rolls over W
slots (position p in slot p % W, ``attention.cache_update``; the mask hides a held key of a previous
chunk, as one outside a window); a global layer keeps the whole context.
The two cannot share one stacked array [L, B, S, Kc * E], so the cache holds two (per shard):
  "k", "v"              [L_global, B, S, Kc * E]  the global layers', in layer order
  "k_local", "v_local"  [L_local, B, W, Kc * E]   the local layers', in layer order
Each layer's per-layer inputs are its kind and its index among the layers of its kind (``kind_index``);
the two arrays travel through the layer stack as part of its carry (``carried_stack``, as every
stacked cache does), and a layer reads its own slice and writes its new tokens into it
(``attention.kinds_cache_attend``). A model with no global layer (fewer layers than
``global_every``) has one kind of layer: its cache is Mistral's (``attention.cache_window``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import meshlm.model.attention as attention
from meshlm.model.attention import LOCAL_KEYS
from meshlm.model.config import ModelConfig

__all__ = ["LOCAL_KEYS", "kind_counts", "kind_index", "carried_stack", "mixed_kinds"]


def mixed_kinds(cfg: ModelConfig) -> bool:
    """True when the layers are of both kinds and the local ones have a window or a chunk, so the cache
    is this module's two arrays (kinds that differ only in rotary, SmolLM3's NoPE layers, share one)."""
    kinds = attention.layer_kinds(cfg)
    return kinds is not None and bool(cfg.local_span) and 0 < int(kinds.sum()) < cfg.n_layers


def kind_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(L_local, L_global): the layers of each kind that keep a cache (``per_layer``: not the reusing)."""
    n_global = int(attention.layer_kinds(cfg)[: cfg.first_shared].sum())  # reusing layers keep none
    return cfg.first_shared - n_global, n_global


def kind_index(cfg: ModelConfig) -> np.ndarray:
    """[n_layers] int32: each layer's index among the layers of its kind (its slice of its cache)."""
    kinds = attention.layer_kinds(cfg)
    return np.asarray([int((kinds[:i] == k).sum()) for i, k in enumerate(kinds)], np.int32)


def carried_stack(cfg: ModelConfig, stacked, body, x, cache, kinds, stats: bool = False):
    """``stack.stack_layers`` with the stacked cache in the loop's carry: ``stacked`` a layer stack with
    per-layer inputs; ``body(x, cache, kind)`` one layer, its cache the stacked arrays and "index", its
    slice of them (this module's two-array cache: its index among its kind's layers, ``kind_index``;
    any other: its layer index); ``kinds`` each layer's kind (None: one kind) -> (x, new cache). Each
    layer writes only its new tokens into the stacked arrays (``attention.cache_write``), so XLA keeps
    one buffer of each, updated in place (as per-layer inputs and outputs the cache would be sliced
    apart and stacked again: copies of it). Inside shard_map the cache must vary over every axis its
    keys and values do (``programs``' prefill types it). With ``stats`` (a mixture of experts)
    ``body`` returns (x, (cache, its routing statistics)), and this (x, new cache, the statistics [L,
    ...]), a per-layer output."""

    def step(carry, index, kind=None):
        x, stacks = carry
        x, new = body(x, {**stacks, "index": index}, kind)
        new, out = new if stats else (new, None)
        return (x, {name: new[name] for name in stacks}), out

    index = kind_index(cfg) if LOCAL_KEYS[0] in cache else np.arange(cfg.n_layers, dtype=np.int32)
    ys = (jnp.asarray(index),) if kinds is None else (jnp.asarray(index), jax.tree.map(jnp.asarray, kinds))
    (x, cache), out = stacked(step)((x, cache), *ys)
    return (x, cache, out) if stats else (x, cache)
