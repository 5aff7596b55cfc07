"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi K2), an attention kind (``MLAFields``).

The queries come through a low-rank down/up projection with a norm (or one plain projection); the keys
and values of every head are up-projected from one per-token latent (normed) and the keys carry one
rotary part shared by all heads next to each head's non-rotary part:

  q = [q_nope | rotary(q_rope)]   per head, from wq_b(q_a_norm(wq_a x))   (or wq x)
  latent, k_rope = wkv_a x        (per token: r + R values; the latent normed by kv_a_norm)
  [k_nope | v] = wkv_b latent     per head;   k = [k_nope | rotary(k_rope)]   (k_rope shared)

Shapes, per shard (``/mp``; r = kv_lora_rank, R = rotary_dim (qk_rope_head_dim), N = head_dim - R
(qk_nope_head_dim), E = head_dim, Ev = v_head_dim, Q = q_lora_rank):
  wq_a [D, Q], q_a_norm/scale [Q], wkv_a [D, r + R], kv_a_norm/scale [r]   replicated over mp: each
      shard computes the latents itself (a plain matmul: JAX casts the weight to per-shard, and the
      transpose of that cast sums its gradient over mp, as for Qwen3's q/k norm weights; the weight
      matmul's custom VJP, ``model.dense``, would need the cast by hand)
  wq_b [Q, H/mp, E] (or wq [D, H/mp, E]), wkv_b [r, H/mp, N + Ev]   column-parallel, by heads
  wo [H/mp, Ev, D]   row-parallel (the caller's ``par.row_out``)

The kernels (plain, blockwise, the cp ring, the decode) take q, k, v of one head width: v is padded
with zeros to E and the output sliced back to Ev (exact: the padding's outputs are zeros, their
gradient discarded). The score scale is ``Variant.scalar`` = E / (YaRN's ``score_mscale``)^2: DeepSeek's
softmax scale E^-1/2 times mscale(factor, mscale_all_dim)^2; YaRN's attention factor multiplies the
rotary parts' cos and sin, q's and k's. Under cp the all-gather strategy gathers the latent and the
rotated rotary key (r + R values per token; full K/V would be 2 H E) and up-projects them on every cp
shard; the ring passes each step's per-head K/V chunk as for every attention (``context_parallel``).

Generation caches the latent and the rotated rotary key (r + R values per token and layer, replicated
over mp), not K/V, and applies ``wkv_b`` to the cache at each step (``MLA._cached``; ``generate.cache``).

The module-level functions (``rotary_key``, ``key_halves``, ``rotate_pair``, ``NORMS``) are the points
the proof's controls replace while the sharded run traces (``proof.mla_faults``).
"""

from __future__ import annotations

import haiku as hk
import jax.numpy as jnp

from meshlm.model.attention import Attention, _attend, cache_write, cp_prefill_cache, layer_view
from meshlm.model.attention_variants import Variant
from meshlm.model.blockwise import blockwise_attention
from meshlm.model.config import ModelConfig
from meshlm.model.context_parallel import context_attention
from meshlm.model.dense import dense_heads_in, dense_heads_out
from meshlm.model.flash import flash_attention, layer_rules
from meshlm.model.layers import RMSNorm, _normal, apply_rotary, rotary_angles
from meshlm.model.rope import YarnScaling, attention_scale
from meshlm.parallel.context import Parallel

NORMS = {"query": RMSNorm, "latent": RMSNorm}  # q_a_norm's and kv_a_norm's (DeepseekV3RMSNorm: Llama's)


def attention_module(cfg: ModelConfig, par: Parallel, stddev: float):
    """The layer's attention: MLA where the config has a latent (``kv_lora_rank``), else ``Attention``."""
    return (MLA if cfg.mla else Attention)(cfg=cfg, par=par, stddev=stddev)


def rotary_key(k_rope, k_nope, rotate):
    """The keys' rotary part [B, S, h, R]: the one rotated k_rope [B, S, R] shared by every head."""
    rotated = rotate(k_rope[:, :, None, :])
    return jnp.broadcast_to(rotated, (*k_nope.shape[:3], rotated.shape[-1]))


def key_halves(nope, rope):
    """A key [.., N + R] from its non-rotary and rotary halves, in the queries' order: nope, then rope."""
    return jnp.concatenate([nope, rope], axis=-1)


def rotate_pair(x, cos, sin, scale: float, style: str, query: bool):
    """The rotary part x [B, T, h, R] rotated, cos and sin times YaRN's attention factor ``scale``: the
    queries' (``query``) and the keys' alike."""
    return apply_rotary(x, cos * scale, sin * scale, x.shape[-1], style)


def score_scalar(cfg: ModelConfig) -> float:
    """``Variant.scalar``: scores divided by sqrt(E / m2^2), i.e. times E^-1/2 m2 (m2 YaRN's
    ``score_mscale``, transformers' mscale(factor, mscale_all_dim)^2; 1 without mscale_all_dim)."""
    m2 = cfg.rope_scaling.score_mscale() if isinstance(cfg.rope_scaling, YarnScaling) else 1.0
    return cfg.head_dim / m2**2


class MLA(hk.Module):
    """Returns the per-shard partial output [B, T, D] (reduce with ``par.row_out``), and the cache."""

    def __init__(self, *, cfg: ModelConfig, par: Parallel, stddev: float, name: str = "attn"):
        super().__init__(name=name)
        self.cfg, self.par, self.stddev = cfg, par, stddev
        self.heads = cfg.n_heads // par.layout.mp  # this shard's heads
        self.nope = cfg.head_dim - cfg.rot_dim

    def _param(self, name, shape):
        return hk.get_parameter(name, shape, init=_normal(self.stddev))

    def _query(self, xf, q_norm):  # [B, T, D] -> [B, T, H/mp, E]
        cfg, d, tap = self.cfg, xf.shape[-1], self.par.tap
        if not cfg.q_lora_rank:
            return dense_heads_in(xf, tap("own_heads", self._param("wq", [d, self.heads, cfg.head_dim])))
        low = q_norm(xf @ self._param("wq_a", [d, cfg.q_lora_rank]))  # [B, T, Q]: every shard alike
        return dense_heads_in(
            low, tap("own_heads", self._param("wq_b", [cfg.q_lora_rank, self.heads, cfg.head_dim]))
        )

    def _latent(self, xf, kv_norm):
        """xf [B, T, D] -> the normed latent [B, T, r], the unrotated k_rope [B, T, R]: every shard alike."""
        cfg, r = self.cfg, self.cfg.kv_lora_rank
        both = xf @ self._param("wkv_a", [xf.shape[-1], r + cfg.rot_dim])
        return kv_norm(both[..., :r]), both[..., r:]

    def _keys_values(self, latent, k_rope, rotate):
        """latent [B, S, r], k_rope [B, S, R] (``rotate``: its rotation, or the identity when it comes
        rotated) -> k [B, S, H/mp, E], v [B, S, H/mp, E] (v zero-padded from Ev to E)."""
        cfg = self.cfg
        w = self._param("wkv_b", [cfg.kv_lora_rank, self.heads, self.nope + cfg.v_head_dim])
        up = dense_heads_in(latent, w)  # [B, S, H/mp, N + Ev]
        k_nope, v = up[..., : self.nope], up[..., self.nope :]
        k = key_halves(k_nope, rotary_key(k_rope, k_nope, rotate))
        return k, jnp.pad(v, [(0, 0)] * 3 + [(0, cfg.head_dim - cfg.v_head_dim)])

    def __call__(self, xf, positions, cache=None, starts=None, kind=None):
        """As ``Attention.__call__`` (no layer kinds: ``kind`` is None). cache: the latent cache
        {"k": [B, S, 1, r] the normed latents, "v": [B, S, 1, R] the rotated rotary keys} (``_cached``)."""
        cfg, par = self.cfg, self.par
        # the norms made here, not in a method: Haiku would scope their names under the method's
        q_norm = NORMS["query"](eps=cfg.norm_eps, name="q_a_norm") if cfg.q_lora_rank else None
        q = self._query(xf, q_norm)
        latent, k_rope = self._latent(xf, NORMS["latent"](eps=cfg.norm_eps, name="kv_a_norm"))
        cos, sin = rotary_angles(positions if starts is None else positions - starts, cfg.inv_freq(), q.dtype)
        scale = attention_scale(cfg.rope_scaling)
        rotate = lambda x, query=False: rotate_pair(x, cos, sin, scale, cfg.rotary_kind, query)
        q = jnp.concatenate([q[..., : self.nope], rotate(q[..., self.nope :], True)], axis=-1)
        variant = Variant.of(cfg, self.heads).replace(scalar=score_scalar(cfg))
        if par.context_parallel and not par.cp_ring and cache is None:  # gather the latent, not K/V
            out = self._gathered(q, latent, rotate(k_rope[:, :, None, :])[:, :, 0], positions, variant)
            return self._out(out, xf), cache
        if cache is not None:
            out, cache = self._cached(
                q, latent, rotate(k_rope[:, :, None, :]), positions, starts, variant, cache
            )
            return self._out(out, xf), cache
        k, v = self._keys_values(latent, k_rope, rotate)
        if par.context_parallel:
            kernel = dict(block=cfg.attn_block, blockwise=cfg.attention == "blockwise", plain_attend=_attend)
            kernel["flash"] = cfg.attention == "flash"  # the ring's steps by flash (``flash_ring``)
            out = context_attention(q, k, v, positions, par, variant=variant, **kernel)
        else:
            out = self._attend(q, k, v, positions, positions, starts, variant)
        return self._out(out, xf), cache

    def _cached(self, q, latent, k_rope, positions, starts, variant, cache):
        """Generation's latent cache (``generate.cache``): this call's latent [B, T, r] and rotated
        k_rope [B, T, 1, R] written at ``positions`` into cache {"k": [B, S, r], "v": [B, S, R]}
        (per shard: each mp shard its own copy), then every slot's keys and values up-projected by
        ``wkv_b`` from the cache (the up-projection applied to the cache, not absorbed into q and
        ``wo``: exact either way) and attended to on this device -> (out [B, T, h, E], cache). A prefill
        over cp writes each shard's chunks and sums the cache over cp (``cp_prefill_cache``): every cp
        shard then holds the whole sequence's latents and attends its queries to them."""
        new = (latent[:, :, None, :], k_rope)
        if self.par.context_parallel:
            cache = cp_prefill_cache(cache, *new, positions, self.par, 0)
            own = layer_view(cache)
            slots = jnp.arange(own["k"].shape[1], dtype=positions.dtype)
            key_pos = jnp.broadcast_to(slots, (positions.shape[0], slots.shape[0]))
        else:  # the stacked cache written in place (``cache_write``)
            cache, own, key_pos = cache_write(cache, *new, positions, 0)
        held = [own[n].astype(q.dtype) for n in "kv"]  # [B, S, r], [B, S, R]: one copy a shard (flat)
        k, v = self._keys_values(*held, lambda x: x)
        return self._attend(q, k, v, positions, key_pos, starts, variant), cache

    def _gathered(self, q, latent, k_rope, positions, variant):
        """cp by all-gather: this shard's latent [B, T/cp, r] and rotated k_rope [B, T/cp, R] gathered
        over cp in one all-gather ([B, T, 1, r + R]), up-projected to every position's keys and values
        here, attended to by this shard's queries (global positions)."""
        par, r, t = self.par, self.cfg.kv_lora_rank, latent.shape[1]
        both = par.gather_kv(jnp.concatenate([latent, k_rope], axis=-1)[:, :, None, :])[:, :, 0]
        k_pos = jnp.concatenate([par.kv_positions(o, t) for o in range(par.layout.cp)])
        k_pos = jnp.broadcast_to(k_pos, (q.shape[0], k_pos.shape[0]))
        k, v = self._keys_values(both[..., :r], both[..., r:], lambda x: x)
        return self._attend(q, k, v, positions, k_pos, None, variant)

    def _attend(self, q, k, v, positions, key_pos, starts, variant):
        """Flash, blockwise or plain attention on one device (no cp, or the gathered latent): [B, T, h, E]."""
        if self.cfg.attention == "flash" and key_pos is positions:  # no KV cache: one sequence (``flash``)
            return flash_attention(q, k, v, starts, variant, candidates=layer_rules(self.cfg))
        if self.cfg.attention == "blockwise":
            kernel = dict(block=self.cfg.attn_block, q_start=starts, variant=variant)
            return blockwise_attention(q, k, v, positions, key_pos, **kernel)
        return _attend(q, k, v, positions, key_pos, starts, variant)

    def _out(self, out, xf):  # out [B, T, H/mp, E] (v padded) -> the row-parallel partial [B, T, D]
        cfg = self.cfg
        wo = self._param("wo", [self.heads, cfg.v_head_dim, xf.shape[-1]])
        return dense_heads_out(out[..., : cfg.v_head_dim], wo)
