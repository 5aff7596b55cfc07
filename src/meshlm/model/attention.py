"""Causal self-attention sharded by heads (Megatron): column-parallel Q/K/V, row-parallel output.

Per shard (``/mp`` = per-shard size; see ``layers`` for the glossary):
  wq [D, H/mp, E]    wk, wv [D, K/mp, E] (or [D, K, E] replicated when mp > K)    wo [H/mp, E, D]
  bq [H/mp, E]       bk, bv [K/mp, E] (or [K, E] replicated)    (Qwen2's q/k/v biases)    bo [D] (gpt-oss)
  q_norm/scale, k_norm/scale [E] replicated                      (Qwen3's per-head q/k RMSNorm)
  q_norm/scale_heads [H/mp, E]   k_norm/scale_heads [K/mp, E] (or [K, E])   (OLMo 2's, over H*E / K*E)

Grouped-query attention: each KV head serves H/K query heads. When mp > K the KV projections are
replicated (Megatron) and each shard computes only the KV head its query heads need; JAX's transpose
of the implicit replicated-to-per-shard cast sums the shards' gradients."""

from __future__ import annotations

import os
from functools import partial

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from meshlm.errors import ConfigError, ShardingError
from meshlm.model import attention_variants as variants  # global_rotated: NoPE, proportional RoPE
from meshlm.model.attention_variants import Variant, mask_mod, rotary_scale, soft_cap, variant_of
from meshlm.model.blockwise import blockwise_attention, varying_like
from meshlm.model.cache_kernel import write_rows
from meshlm.model.config import ModelConfig
from meshlm.model.context_parallel import context_attention
from meshlm.model.dense import add_once, dense_heads_in, dense_heads_out
from meshlm.model.flash import flash_attention, layer_rules
from meshlm.model.flash_kernel import ATTN_OUT
from meshlm.model.layers import RMSNorm, RMSNormPlusOne, _normal, apply_rotary, rotary_angles, upcast
from meshlm.model.lora import adapted
from meshlm.model.quant import matmul
from meshlm.model.rope import inv_freq
from meshlm.parallel.context import Parallel


def kv_replicated(n_kv_heads: int, mp: int) -> bool:
    """True when KV heads are replicated over the model axis (mp > K); errors if neither works."""
    if n_kv_heads % mp == 0:
        return False
    if mp % n_kv_heads == 0:
        return True
    raise ShardingError(
        f"n_kv_heads={n_kv_heads} and mp={mp}: mp must divide n_kv_heads or be a multiple of it"
    )


def _mm(attn, kind: str):
    """A projection's matmul: float, or int8 under ``cfg.quant`` (``model.quant``); ``kind``: "col" (to
    heads) or "row" (the output: heads split over mp)."""
    return partial(matmul, attn.par, attn.cfg.quant, kind)


def _local(cfg, q, k, v, positions, key_pos, starts, variant):
    """The attention of one device's heads by ``cfg.attention``'s kernel (blockwise or plain; flash and
    cp are ``Attention._attend``'s own), reading a flat KV cache as it lies or viewed as heads
    (``cache_heads``)."""
    if cfg.attention == "blockwise":
        kernel = dict(block=cfg.attn_block, q_start=starts, variant=variant)
        return blockwise_attention(q, *cache_heads(q, k, v, always=True), positions, key_pos, **kernel)
    return _attend(q, *cache_heads(q, k, v), positions, key_pos, starts, variant)


class Attention(hk.Module):
    """Returns the per-shard partial output [B, T, D] (reduce with ``par.row_out``)."""

    def __init__(self, *, cfg: ModelConfig, par: Parallel, stddev: float, name: str = "attn"):
        super().__init__(name=name)
        self.cfg, self.par, self.stddev = cfg, par, stddev
        self.style = cfg.rotary_kind

    def _proj(self, name, xf, heads, tap=None, width=1):  # xf [B, T, D] -> [B, T, heads, width * E]
        shape = [xf.shape[-1], heads, width * self.cfg.dim_per_head]
        w = hk.get_parameter(name, shape, init=_normal(self.stddev))
        y = dense_heads_in(xf, w if tap is None else self.par.tap(tap, w), _mm(self, "col"))
        return self._biased(name, adapted(self.cfg, self.par, "attn/" + name, xf, y, xf.shape[-1:]), heads)

    def _biased(self, name, y, heads, index=None):
        """y [B, T, h, E] plus the projection's bias (Qwen2's q/k/v; ``Family.qkv_bias``): column-
        parallel, [heads, E] per shard; replicated KV heads' bias [K, E] is sliced at ``index`` as its
        weight is. The bias is added on every shard: each holds different heads, no sum follows."""
        if not self.cfg.arch.qkv_bias:
            return y
        b = hk.get_parameter("b" + name[1:], [heads, self.cfg.dim_per_head], init=jnp.zeros)
        if index is not None:
            b = lax.dynamic_slice_in_dim(b, index, 1, axis=0)  # [1, E]: this shard's KV head
        return y + self.par.tap("head_bias", b)  # [heads, E]: this shard's heads' slice

    def _kv(self, xf):  # -> k, v [B, T, K_local, E]
        cfg, par = self.cfg, self.par
        if not kv_replicated(cfg.kv_heads, par.layout.mp):
            kl = cfg.kv_heads // par.layout.mp
            return self._proj("wk", xf, kl), self._proj("wv", xf, kl)
        idx = par.kv_head_index(cfg.n_heads, cfg.kv_heads)
        out = []
        for name in ("wk", "wv"):
            w = hk.get_parameter(
                name, [xf.shape[-1], cfg.kv_heads, cfg.dim_per_head], init=_normal(self.stddev)
            )
            w1 = lax.dynamic_slice_in_dim(w, idx, 1, axis=1)  # [D, 1, E]: this shard's KV head
            y = adapted(cfg, par, "attn/" + name, xf, dense_heads_in(xf, w1), xf.shape[-1:], w.shape[1:], idx)
            out.append(self._biased(name, y, cfg.kv_heads, idx))
        return out

    def _norm_args(self, keys: bool) -> dict:
        """What OLMo 2's whole-projection norm of q (or of k) needs beyond its name (``ProjRMSNorm``)."""
        cfg, par = self.cfg, self.par
        if cfg.arch.qk_norm != "proj":
            return {}
        first = cfg.arch.norm == "rms_product_first"  # as the family's norms (OLMo 2; OLMoE: as Llama)
        if not keys:
            return dict(par=par, heads=cfg.n_heads, index=None, product_first=first)
        replicated = kv_replicated(cfg.kv_heads, par.layout.mp)
        index = par.kv_head_index(cfg.n_heads, cfg.kv_heads) if replicated else None
        return dict(par=par, heads=cfg.kv_heads, index=index, product_first=first)

    def __call__(self, xf, positions, cache=None, starts=None, kind=None):
        """xf: [B, T, D] per-shard view; positions: [B, T] absolute positions.

        cache: None (training) or {"k", "v": [B, S, K_local * E]} (flat): new keys/values are written at
        ``positions`` and queries attend to every cached slot at or before their position.
        starts: None, or [B, T] (``--doc-mask``) the absolute position where each query's document
        starts: it sees only keys at or after it, and its rotary position restarts there.
        kind: None (every layer alike), or this layer's kind, a traced int32 scalar (``layer_kinds``:
        0 local, 1 global), which picks its window and rotary frequencies (``kind_tables``).
        Returns (partial [B, T, D], new cache or None)."""
        cfg = self.cfg
        hl = cfg.n_heads // self.par.layout.mp
        # [B, T, H/mp, E]: this shard's query heads (``Family.attn_gate``: each head's query, then its gate)
        q = self._proj("wq", xf, hl, "own_heads", 1 + cfg.arch.attn_gate)
        q, gate = q[..., : cfg.dim_per_head], q[..., cfg.dim_per_head :]  # gate: [B, T, H/mp, 0] ungated
        q, k, v = _named(q, *self._kv(xf))  # k, v [B, T, K_local, E]
        variant = layer_variant(cfg, kind, hl)
        rotate = lambda x: x  # a layer without rotary (``variant.rotary`` None)
        if variant.rotary is not None:
            rotary = positions if starts is None else positions - starts
            cos, sin = rotary_angles(rotary, variant.rotary, q.dtype, rotary_scale(cfg, kind))
            rotate = lambda x: apply_rotary(x, cos, sin, cfg.rot_dim, self.style)
        if cfg.arch.qk_norm is None:
            q, k = rotate(q), rotate(k)
        else:  # made here, not in a method: Haiku would scope their names under the method's
            norm = QK_NORMS[cfg.arch.qk_norm]
            q = norm_then_rotary(q, norm(eps=cfg.norm_eps, name="q_norm", **self._norm_args(False)), rotate)
            k = norm_then_rotary(k, norm(eps=cfg.norm_eps, name="k_norm", **self._norm_args(True)), rotate)
        q, k = variant.queries(q, k, positions)  # Llama 4's L2 norm and temperature (none: as they were)
        key_pos = positions
        if cache is not None and LOCAL_KEYS[0] in cache:  # Gemma 2/3's local and global caches (``kv_kinds``)
            attend = lambda q, k, v, key_pos, w: self._attend(
                q, k, v, positions, key_pos, starts, variant.replace(window=w)
            )
            out, cache = kinds_cache_attend(cfg, cache, q, k, v, positions, kind, attend)
            return self._out(out, xf, gate), cache
        if cache is not None and self.par.context_parallel:  # a prefill over cp: attend to the chunks
            cache = cp_prefill_cache(cache, k, v, positions, self.par, cache_window(cfg))
        elif cache is not None:
            cache, own, key_pos = cache_write(cache, k, v, positions, cache_window(cfg))
            k, v = own["k"].astype(q.dtype), own["v"].astype(q.dtype)
        if self.par.context_parallel:  # the sequence split over cp: positions global
            blockwise = cfg.attention == "blockwise"  # (no --doc-mask with cp: ``transformer``)
            kernel = dict(block=cfg.attn_block, blockwise=blockwise, plain_attend=_attend, variant=variant)
            kernel["flash"] = cfg.attention == "flash"  # the ring's steps by flash (``flash_ring``)
            out = context_attention(q, k, v, positions, self.par, **kernel)
        else:
            out = self._attend(q, k, v, positions, key_pos, starts, variant)
        return self._out(out, xf, gate), cache

    def _attend(self, q, k, v, positions, key_pos, starts, variant):  # [B, T, h, E] "attn_out" (memory)
        if self.cfg.attention == "flash" and key_pos is positions:  # no KV cache: one sequence (``flash``)
            return flash_attention(q, k, v, starts, variant, candidates=layer_rules(self.cfg))
        return checkpoint_name(_local(self.cfg, q, k, v, positions, key_pos, starts, variant), ATTN_OUT)

    def _out(self, out, xf, gate):  # out, gate [B, T, H/mp, E] -> the row-parallel partial [B, T, D]
        hl = self.cfg.n_heads // self.par.layout.mp
        out = out * jax.nn.sigmoid(gate) if self.cfg.arch.attn_gate else out  # Qwen3.5's output gate
        wo = hk.get_parameter("wo", [hl, self.cfg.dim_per_head, xf.shape[-1]], init=_normal(self.stddev))
        y = dense_heads_out(out, wo, _mm(self, "row"))  # [B, T, D] partial over mp
        out = adapted(self.cfg, self.par, "attn/wo", out, y, wo.shape[:2])
        if not self.cfg.arch.o_bias:  # gpt-oss's output bias [D]: once in the row sum (``add_once``)
            return out
        return add_once(self.par, out, hk.get_parameter("bo", [xf.shape[-1]], init=jnp.zeros))


def _named(q, k, v):
    """q, k, v named for the remat policies that save them (``model.memory``: --remat save_qkv_proj);
    an identity otherwise."""
    return (checkpoint_name(x, n) for x, n in ((q, "q_proj"), (k, "k_proj"), (v, "v_proj")))


def layer_kinds(cfg: ModelConfig):
    """[n_layers] int32 numpy, each layer's kind (0 local, 1 global: ``ModelConfig.global_every``), the
    layer stack's per-layer input; None where every layer is alike (no per-layer input)."""
    if not cfg.global_every:
        return None
    return ((np.arange(cfg.n_layers) + 1) % cfg.global_every == 0).astype(np.int32)


def layer_variant(cfg: ModelConfig, kind, heads: int) -> Variant:
    """This layer's attention variant (``attention_variants``) for its ``heads`` query heads on this
    shard: the model's window and rotary, or with a traced ``kind`` (Gemma 2/3's local and global
    layers) the kind's, from ``kind_tables``."""
    if kind is None:
        return Variant.of(cfg, heads, window=cfg.sliding_window, rotary=cfg.inv_freq())
    windows, freqs = (jnp.asarray(table)[kind] for table in kind_tables(cfg))
    return Variant.of(cfg, heads, window=windows, rotary=freqs, kind=kind)


def kind_tables(cfg: ModelConfig):
    """(windows [2] int32, inverse frequencies [2, rot_dim / 2] float64), numpy, by kind (0 local, 1 global):
    a local layer sees ``sliding_window`` keys, plain RoPE of ``rope_local_theta`` (or the global one's,
    ``Family.rope_scales_local``), a global one all, ``rope_theta`` scaled, or 0s (``global_rotated``)."""
    windows = np.asarray([cfg.sliding_window, 0], np.int32)
    plain = inv_freq(cfg.rot_dim, cfg.rope_local_theta or cfg.rope_theta)
    local = cfg.inv_freq() if cfg.arch.rope_scales_local else plain
    full = cfg.inv_freq() * variants.global_rotated(cfg)  # zeros: the identity (cos 0 = 1, sin 0 = 0)
    return windows, np.stack([local, full])


class ProjRMSNorm(hk.Module):
    """OLMo 2's (and OLMoE's) q or k norm: RMSNorm over the whole projection, all heads' E together.

    x [B, T, h, E] is this shard's heads (h = heads/mp; with replicated KV heads the one KV head it
    computes, ``index``); weights ``scale_heads`` [heads/mp, E] (or [heads, E] replicated, sliced at
    ``index``: as Qwen2's KV bias). The sum of squares is this shard's, summed over mp (``par.g``: its
    backward is the identity, and the transpose of the shared statistic's use sums its cotangent);
    a KV head held by mp / K shards is counted that many times, so the sum is divided by that.
    In float32 (at least); the weight product before the cast if ``product_first`` (Olmo2RMSNorm), else after.
    """

    def __init__(self, *, eps: float, par: Parallel, heads: int, index=None, product_first=True, name: str):
        super().__init__(name=name)
        self.eps, self.par, self.heads, self.index, self.product_first = eps, par, heads, index, product_first

    def mean_square(self, x32):
        """[B, T, 1, 1]: the mean of x^2 over the whole projection (all heads, all shards)."""
        local = jnp.sum(jnp.square(x32), axis=(-2, -1), keepdims=True)
        copies = self.par.layout.mp // self.heads if self.index is not None else 1
        return self.par.g(local) / (copies * self.heads * x32.shape[-1])

    def __call__(self, x):
        stored = self.heads if self.index is not None else x.shape[-2]
        w = hk.get_parameter("scale_heads", [stored, x.shape[-1]], init=jnp.ones)
        if self.index is not None:
            w = lax.dynamic_slice_in_dim(w, self.index, 1, axis=0)  # [1, E]: this shard's KV head
        x32 = upcast(x)
        y = x32 * lax.rsqrt(self.mean_square(x32) + self.eps)
        return (upcast(w) * y if self.product_first else w * y.astype(x.dtype)).astype(x.dtype)


# The q/k norms (``Family.qk_norm``): "head" is Qwen3's RMSNorm over each head's E, its weights [E] shared
# by every head (replicated over mp: JAX sums their gradient over mp, the transpose of the replicated-to-
# per-shard cast); "head_plus_one" is Gemma 3's, times (1 + w); "proj" is OLMo 2's (``ProjRMSNorm``).
QK_NORMS = {"head": RMSNorm, "head_plus_one": RMSNormPlusOne, "proj": ProjRMSNorm}


def norm_then_rotary(x, norm, rotate):
    """x [B, T, h, E] normalized, then rotated (transformers' order: the weights meet unrotated heads)."""
    return rotate(norm(x))


def doc_starts(tokens, eod: int):
    """[B, T] window -> where each token's document starts (contiguous: [start, own position]): an EOD
    starts a document (the first input of the one it precedes), and so does the window's first token."""
    t = jnp.arange(tokens.shape[-1])
    return lax.cummax(jnp.where(tokens == eod, t, 0), axis=tokens.ndim - 1)


LOCAL_KEYS = ("k_local", "v_local")  # the local layers' cache arrays beside "k", "v" (``kv_kinds``)


def cache_window(cfg: ModelConfig) -> int:
    """The slots of a rolling KV cache in every layer: the window (or chunk) when every layer has it
    (Mistral, or a Gemma with fewer layers than ``global_every``), else 0 (a model with local and full
    layers, Gemma 2/3, Llama 4, keeps a rolling cache in its local layers only: ``kv_kinds``)."""
    return 0 if cfg.global_every and cfg.n_layers >= cfg.global_every else cfg.local_span


def cache_update(cache, k, v, positions, window: int):
    """Write the new k, v [B, T, K_local, E] at ``positions`` [B, T] into ``cache`` {"k", "v": [B, S,
    K_local * E]} (flat, ``generate.cache``): (new cache, key positions [B, S] of its slots).

    A full cache (S != ``window``) holds position p in slot p. A rolling one (S == ``window``: memory
    O(window), not O(context)) holds p in slot p % S: after writing position q, slot s holds the
    newest position congruent to s, q - ((q - s) mod S), every one of them inside q's window; a slot
    not yet written (that position < 0) gets a position no query sees. The two agree while positions
    are below S (slot s holds s), so a prefill of S <= window tokens fills either."""
    at, key_pos = _slots(positions, cache["k"].shape[1], window)
    write = jax.vmap(lambda c, new, p: c.at[p].set(new.reshape(*new.shape[:1], *c.shape[1:]).astype(c.dtype)))
    return {"k": write(cache["k"], k, at), "v": write(cache["v"], v, at)}, key_pos


def _slots(positions, slots: int, window: int):
    """(the slot [B, T] each of ``positions`` [B, T] is written at, the key positions [B, S] the slots
    hold after the write) for a cache of ``slots`` per layer (``cache_update``)."""
    rolling = bool(window) and slots == window
    slot = jnp.arange(slots, dtype=positions.dtype)
    if not rolling:
        return positions, jnp.broadcast_to(slot, (positions.shape[0], slots))
    last = positions[:, -1:]  # [B, 1]: the newest position written
    held = last - (last - slot) % slots  # [B, S]
    return positions % slots, jnp.where(held < 0, jnp.iinfo(held.dtype).max, held)  # never written: unseen


def cache_write(cache, k, v, positions, window: int):
    """``cache_update`` -> (new cache, this layer's {"k", "v"} [B, S, K_local * E], key positions).

    ``cache`` is one layer's {"k", "v"} [B, S, K_local * E], or (carried through the layer loop:
    ``kv_kinds.carried_stack``) the stacked {"k", "v"} [L, B, S, K_local * E] and "index", this layer's.
    The stacked arrays are written only at [index, b, positions[b]] (``_put``), so XLA updates the one
    buffer in place: a decode step writes its new tokens, not copies of the cache."""
    if "index" not in cache:
        cache, key_pos = cache_update(cache, k, v, positions, window)
        return cache, cache, key_pos
    new, own, key_pos = stacked_write(cache, ("k", "v"), cache["index"], k, v, positions, window)
    return {**new, "index": cache["index"]}, own, key_pos


def stacked_write(stacks: dict, names, index, k, v, positions, window: int):
    """Write k, v [B, T, K_local, E] at layer ``index`` of ``stacks[names[0]]``, ``stacks[names[1]]``
    ([L, B, S, K_local * E]) -> (the stacks, the layer's {"k", "v"} [B, S, ...], key positions [B, S])."""
    at, key_pos = _slots(positions, stacks[names[0]].shape[2], window)
    new = dict(stacks)
    for name, x in zip(names, (k, v), strict=True):
        new[name] = _put(stacks[name], index, at, x.astype(stacks[name].dtype))
    own = layer_view({"k": new[names[0]], "v": new[names[1]], "index": index})
    return new, own, key_pos


def _put(stack, index, at, x):
    """``stack`` [L, B, S, F] (the flat cache, ``generate.cache``) with x [B, T, Kc, E] written at [index,
    b, at[b, t]] (x flattened to [B, T, Kc * E]), in place: ONE scatter for every row and token, or on a
    TPU, for a decode step's one token a row, a Pallas kernel writing each row's tile block
    (``cache_kernel.write_rows``: the same values). (A dynamic-update-slice per row was one kernel per
    row and layer, 2 x B x L a decode step: 1024 at batch 64 on llama-100m, each ~1 us on a TPU; it also
    made XLA:TPU relayout the cache, see ``generate.cache``.) Cost analysis counts a scatter's whole
    operand: its "bytes accessed" are not the step's."""
    return write_rows(stack, index, at, x.reshape(*x.shape[:2], *stack.shape[3:]))


def kinds_cache_attend(cfg: ModelConfig, cache: dict, q, k, v, positions, kind, attend):
    """One layer's attention with the two-array cache: (out [B, T, h, E], new cache).

    cache (per shard, ``kv_kinds``): the global layers' "k", "v" [L_global, B, S, Kc * E], the local
    ones' "k_local", "v_local" [L_local, B, W (``local_span``; S in the prefill), Kc * E], "index" its
    index among the layers of its kind (traced). ``kind`` (traced, 0 local) picks the branch: a local
    layer writes k, v [B, T, Kc, E] into its W-slot slice (rolling, or full while the prefill holds all
    S slots: ``keep_window`` cuts them after) and attends with its window or chunk; a global one
    into its S-slot slice, without one (a Python ``kind``: that branch alone). ``attend(q, k, v,
    key_pos, window)``: its attention on one device."""
    index = cache["index"]
    # both branches return all four arrays: typed alike (inside shard_map), varying as k and v do
    stacks = varying_like({name: cache[name] for name in ("k", "v", *LOCAL_KEYS)}, k, v)

    def branch(names, span, window):  # span: the rolling slots (a chunk's too), window: the mask's
        def run(stacks):
            new, own, key_pos = stacked_write(stacks, names, index, k, v, positions, span)
            return attend(q, own["k"].astype(q.dtype), own["v"].astype(q.dtype), key_pos, window), new

        return run

    local, full = branch(LOCAL_KEYS, cfg.local_span, cfg.sliding_window), branch(("k", "v"), 0, 0)
    static = isinstance(kind, int)  # a run of one kind (``per_layer_runs``: the kinds' shapes may differ)
    out, stacks = (full if kind else local)(stacks) if static else lax.cond(kind == 0, local, full, stacks)
    return out, {**stacks, "index": index}


def cp_prefill_cache(cache, k, v, positions, par: Parallel, window: int) -> dict:
    """A prefill over cp (``generate.programs``): this shard's chunks' k, v [B, T/cp, K_local, E] written
    at their global ``positions`` [B, T/cp] into ``cache`` (zeros, [B, T, K_local * E]), then summed over
    cp (``Parallel.cp_sum``). Every slot is written by exactly one shard and is zero on the others, so
    the sum is exact: the whole sequence's cache, in sequence order, the same on every cp shard (the
    decode then runs without cp, each cp shard a copy)."""
    if "index" in cache:  # the stacked cache (``cache_write``): this layer's slice, summed, put back
        index = cache["index"]
        own = cp_prefill_cache(layer_view(cache), k, v, positions, par, window)
        put = lambda n: lax.dynamic_update_index_in_dim(cache[n], own[n].astype(cache[n].dtype), index, 0)
        return {"k": put("k"), "v": put("v"), "index": index}
    cache, _ = cache_update(cache, k, v, positions, window)
    return {name: par.cp_sum(c) for name, c in cache.items()}


def layer_view(cache: dict) -> dict:
    """This layer's {"k", "v"} [B, S, Kc * E] (flat, ``generate.cache``) of a cache: the cache itself,
    or its slice at "index" of the stacked one (``cache_write``)."""
    if "index" not in cache:
        return cache
    return {n: lax.dynamic_index_in_dim(cache[n], cache["index"], 0, False) for n in "kv"}


def window_visible(q_pos, k_pos, window):
    """Whether a query at ``q_pos`` sees a key at ``k_pos`` (``mask_mod``'s causal window; ``window`` an
    int or a traced int32, 0: none). Plain attention's hook (a test plants a wrong window here)."""
    if isinstance(window, int):
        return mask_mod(q_pos, k_pos, True, window=window or None)
    return mask_mod(q_pos, k_pos, True, window=window)


def capped_softmax(scores, visible, softcap: float):
    """Probabilities over the keys (last axis): scores soft-capped, masked, softmax (transformers')."""
    scores = jnp.where(visible, soft_cap(scores, softcap), jnp.finfo(scores.dtype).min)
    return jax.nn.softmax(scores, axis=-1)


# Queries per row up to which attention reads a flat cache [B, S, Kc * E] as it is (``_flat_scores``: a
# decode step's 1, a speculative check's few); a longer call (a prefill) views it as heads (a copy).
FLAT_QUERIES = 16


def as_heads(x, width: int):
    """A flat cache's [B, S, Kc * E] as [B, S, Kc, E] (``width`` = E); heads as they are."""
    return x if x.ndim == 4 else x.reshape(*x.shape[:2], x.shape[2] // width, width)


def cache_heads(q, k, v, always: bool = False):
    """k, v as attention reads them: a flat cache's [B, S, Kc * E] as it lies for up to ``FLAT_QUERIES``
    queries q [B, T, h, E] (``_flat_scores``), as heads [B, S, Kc, E] for more or ``always``."""
    if k.ndim == 4 or (q.shape[1] <= FLAT_QUERIES and not always):
        return k, v
    kv = k.shape[-1] // q.shape[-1]
    return as_heads(k, q.shape[-1]), as_heads(v, v.shape[-1] // kv)


def _flat_scores(qg, k):
    """qg [B, T, Kc, g, E] against a flat cache k [B, S, Kc * E] -> [B, Kc, g, T, S] (``_attend``'s
    "bkgts"), read as it lies: one matmul [S, Kc * E] x [Kc * E, Kc * g * T] per row with the queries
    block-diagonal (query head (k, g) is zero outside KV head k's E columns: the zeros add exactly
    nothing). Kc times the FLOPs of the heads' form, all on the MXU and far below the cache's bytes."""
    b, t, kv, g, e = qg.shape
    eye = jnp.eye(kv, dtype=bool)[:, None, :, None, None]  # [Kc (cache's), 1, Kc (queries'), 1, 1]
    qd = jnp.where(eye, jnp.transpose(qg, (0, 4, 2, 3, 1))[:, None], jnp.zeros((), qg.dtype))
    scores = jnp.einsum("bsf,bfn->bns", k, qd.reshape(b, kv * e, kv * g * t))  # [B, Kc * g * T, S]
    return scores.reshape(b, kv, g, t, k.shape[1])


# "apart" (unset): ``_flat_out``'s matmul kept apart from its block selection (an optimization barrier);
# "fused": XLA may fuse them (the program before, to measure one against the other on a chip).
VALUES_ENV = "MESHLM_FLAT_VALUES"


def values_apart() -> bool:
    """``MESHLM_FLAT_VALUES``: "apart" (unset) or "fused"; anything else is an error. Read when traced."""
    mode = os.environ.get(VALUES_ENV, "") or "apart"
    if mode not in ("apart", "fused"):
        raise ConfigError(f"{VALUES_ENV}={mode!r}: use apart or fused (or leave it unset)")
    return mode == "apart"


def _flat_out(probs, v):
    """probs [B, Kc, g, T, S] times a flat cache v [B, S, Kc * Ev] -> [B, T, Kc, g, Ev]: every query
    head against every KV head's values (one matmul a row), then each head's own block kept (the
    others dropped: a select, exact)."""
    b, kv, g, t, s = probs.shape
    ev = v.shape[-1] // kv
    full = jnp.einsum("bns,bsf->bnf", probs.reshape(b, kv * g * t, s), v)  # [B, Kc * g * T, Kc * Ev]
    if values_apart():
        # Why apart: at one row (a decode step at batch 1) XLA:TPU fused the matmul with the selection
        # into one vector-unit reduction that reads the values with S minor, so it copied each layer's
        # values transposed out of the cache every step (4176 x 768 bf16, 6.4 MB a layer at a 4096-token
        # prompt); apart, the matmul reads the cache as it lies, the slice of its layer fused in
        # (scripts/decode_hlo.py, docs/benchmarks.md "Decode: the values apart"). Identity elsewhere.
        full = lax.optimization_barrier(full)
    full = full.reshape(b, kv, g, t, kv, ev)
    eye = jnp.eye(kv, dtype=bool)[:, None, None, :, None]  # [Kc (queries'), 1, 1, Kc (values'), 1]
    out = jnp.sum(jnp.where(eye, full, jnp.zeros((), full.dtype)), axis=4)  # [B, Kc, g, T, Ev]
    return jnp.transpose(out, (0, 3, 1, 2, 4))


def _attend(q, k, v, q_pos, k_pos, starts=None, variant=None, **fields):
    """Causal grouped attention, softmax in float32. q [B,T,h,E]; k, v [B,S,kv,E], or a flat cache's
    [B,S,kv*E] (``_flat_scores``, ``_flat_out``: the same values); pos [B,T]/[B,S].
    ``starts`` [B, T]: where each query's document starts; it sees only keys from there on.
    ``variant`` (``attention_variants.Variant``; or a window, with the variant's other ``fields``): what a
    query sees (a window > 0: a query at i sees keys j with i - window < j <= i) and what happens to its
    scores (divided by sqrt(scalar or E), then the score rule before the mask, as transformers)."""
    variant = variant if isinstance(variant, Variant) else variant_of(window=variant, **fields)
    b, t, h, e = q.shape
    flat = k.ndim == 3
    kv = k.shape[2] // e if flat else k.shape[2]
    qg = q.reshape(b, t, kv, h // kv, e)
    scores = upcast(_flat_scores(qg, k) if flat else jnp.einsum("btkge,bske->bkgts", qg, k))
    scores = scores / jnp.sqrt(jnp.asarray(variant.scalar or e, scores.dtype))
    qp, kp = q_pos[:, None, None, :, None], k_pos[:, None, None, None, :]
    rules = variant.rules()
    visible = window_visible(qp, kp, rules.pop("window", 0))  # causality and the window
    if starts is not None or rules:  # document starts, and any further mask rule
        qs = None if starts is None else starts[:, None, None, :, None]
        visible = visible & mask_mod(qp, kp, False, qs, **rules)
    probs = capped_softmax(scores, visible, variant.softcap)
    probs = variant.finish_probs(probs, scores, visible).astype(v.dtype)
    out = _flat_out(probs, v) if flat else jnp.einsum("bkgts,bske->btkge", probs, v)
    return out.reshape(b, t, h, out.shape[-1])
