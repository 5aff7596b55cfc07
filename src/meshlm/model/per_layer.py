"""Per-layer input embeddings and keys and values shared across layers (Gemma 4's text model), as one
layer stack whose carry holds, beside the residual stream, the keys and values each kind of layer last
computed; the config's fields are ``per_layer_fields.PerLayerFields``.

Shapes (per shard; ``layers`` for the glossary): x [B, T, D] replicated over mp; the per-layer inputs
[L, B, T, P] (P = ``ple_dim``), replicated; the shared keys and values {"k", "v": [2, B, T, Kl, E]} by
kind (0 local, 1 global), Kl = this shard's KV heads (1 where mp > K: the head its query heads read).

- **Per-layer inputs** (transformers' ``get_per_layer_inputs`` and ``project_per_layer_inputs``): the
  tokens' rows of a second, vocabulary-parallel table [V', L x P] times sqrt(P), plus the scaled
  embeddings projected by [D, L x P] times 1/sqrt(D) and RMS-normed over P, the sum times 1/sqrt(2);
  layer i reads slice i. After the layer's MLP: x + norm(w_out(gelu(w_gate(x)) * its slice)).
- **Keys as values** (``k_eq_v``): a global layer's values are its keys' projection, before the k norm
  and rotary, through the value norm; its ``wv`` is not read (zeros from transformers, not written back).
- **Shared KV** (``kv_shared_layers``): a layer from ``first_shared`` on reads the keys and values its
  kind's slot of the carry holds (the last earlier layer of its kind wrote them: transformers'
  ``shared_kv_states``); its own ``wk``, ``wv`` are not read (as above). In generation it attends over
  that layer's cache slice (``cache_index``): its write there puts back the very values already there.
Parameters stay uniform over the layers (one scan, ``hk.experimental.layer_stack``), or with global
layers of their own attention shape two stacks run in runs of one kind (``per_layer_runs``); the
pipeline refuses the stack in one line (``sharding.rules``).
"""

from __future__ import annotations

import haiku as hk
import jax.numpy as jnp
import numpy as np
from jax import lax

import meshlm.model.attention as attention
from meshlm.model.attention import (
    QK_NORMS,
    Attention,
    _attend,
    cache_update,
    cache_window,
    kinds_cache_attend,
    layer_variant,
)
from meshlm.model.attention_variants import rotary_scale
from meshlm.model.context_parallel import context_attention
from meshlm.model.dense import dense
from meshlm.model.kv_kinds import kind_index
from meshlm.model.layer_loop import layer_stack
from meshlm.model.layers import (
    RMSNormProductFirst,
    VocabEmbed,
    _normal,
    apply_rotary,
    gelu_tanh,
    rotary_angles,
    upcast,
    varying_like,
)
from meshlm.model.memory import layer_gathers, remat_body
from meshlm.model.moe import MoE

STDDEV = 0.02  # GPT-J / Llama initialisation, as ``transformer.GPT_STDDEV``


def inputs(cfg, par, tokens, x):
    """tokens [B, T], x [B, T, D] the scaled embeddings -> the per-layer inputs [L, B, T, P] (None
    without ``ple_dim``): transformers' token part and context part, summed and scaled by 1/sqrt(2)."""
    if not cfg.ple_dim:
        return None
    big, p = cfg.n_layers * cfg.ple_dim, cfg.ple_dim
    vocab = cfg.ple_vocab or cfg.vocab_size
    table = VocabEmbed(vocab_size=vocab, d_model=big, par=par, stddev=STDDEV, name="embed_per_layer")
    token = table(tokens) * jnp.asarray(np.float32(np.sqrt(p)), x.dtype)  # as Gemma's embedding scale
    context = Linear(big, name="ple_proj")(x) * (x.shape[-1] ** -0.5)
    split = lambda a: a.reshape(*a.shape[:-1], cfg.n_layers, p)
    context = RMSNormProductFirst(eps=cfg.norm_eps, name="ple_norm")(split(context))
    return jnp.moveaxis((context + split(token)) * (2.0**-0.5), 2, 0)


class Linear(hk.Module):
    """x [..., K] @ w [K, M], w replicated (every shard computes the same: no collective)."""

    def __init__(self, out: int, name: str):
        super().__init__(name=name)
        self.out = out

    def __call__(self, x):
        w = hk.get_parameter("w", [x.shape[-1], self.out], init=_normal(STDDEV))
        return dense(x, w.astype(x.dtype))


class PerLayerInput(hk.Module):
    """After a layer's MLP: x + norm(w_out(gelu_tanh(w_gate(x)) * its input [B, T, P])), per token."""

    def __init__(self, cfg, name: str = "ple"):
        super().__init__(name=name)
        self.cfg = cfg

    def __call__(self, x, ple):
        gate = gelu_tanh(Linear(self.cfg.ple_dim, name="gate")(x))
        out = Linear(x.shape[-1], name="out")(gate * ple.astype(x.dtype))
        return x + RMSNormProductFirst(eps=self.cfg.norm_eps, name="ple_ln")(out)


class LayerScalar(hk.Module):
    """x times the layer's scale [1] (transformers' ``layer_scalar``)."""

    def __init__(self, name: str = "layer_scalar"):
        super().__init__(name=name)

    def __call__(self, x):
        return x * hk.get_parameter("scale", [1], init=jnp.ones).astype(x.dtype)


def value_normed(v, eps: float):
    """Values [B, T, h, E] RMS-normed over E without a weight (Gemma 4's ``v_norm``), in float32+."""
    v32 = upcast(v)
    return (v32 * lax.rsqrt(jnp.mean(jnp.square(v32), -1, keepdims=True) + eps)).astype(v.dtype)


def keys_as_values(kind, k, v):
    """A global layer's (``kind`` 1) values [B, T, Kl, E]: its keys' projection ``k``; others' ``v``."""
    return jnp.where(kind == 1, k, v)


def in_layer_order(ple):
    """The per-layer inputs [L, B, T, P] as the stack hands them out: slice i to layer i."""
    return ple


def read_shared(shared, k, v, kind, reuse):
    """(k, v, new shared): a reusing layer's (``reuse`` True) the keys and values of its kind's slot,
    any other layer's its own, written to that slot (a reusing layer's write puts back what it read)."""
    got = {}
    for name, own in (("k", k), ("v", v)):
        got[name] = jnp.where(reuse, lax.dynamic_index_in_dim(shared[name], kind, 0, False), own)
    new = {name: lax.dynamic_update_index_in_dim(shared[name], got[name], kind, 0) for name in got}
    return got["k"], got["v"], new


class SharedKVAttention(Attention):
    """``attention.Attention`` with keys as values on the global layers, the value norm and the keys
    and values of an earlier layer (``shared``, ``read_shared``). Returns (partial [B, T, D], shared,
    cache)."""

    def __call__(
        self, xf, positions, cache=None, starts=None, kind=None, shared=None, reuse=False, slot=None
    ):
        cfg = self.cfg  # ``slot``: this layer's kind's slot of ``shared`` (default: ``kind``)
        hl = cfg.n_heads // self.par.layout.mp
        q = self._proj("wq", xf, hl, "own_heads")  # [B, T, H/mp, E]
        k, v = self._kv(xf)  # [B, T, Kl, E]
        kind = jnp.int32(0) if kind is None else kind
        if cfg.k_eq_v:  # the global layers' values: their keys' projection, before its norm and rotary
            v = keys_as_values(kind, k, v)
        variant = layer_variant(cfg, kind if cfg.global_every else None, hl)
        rotary = positions if starts is None else positions - starts
        cos, sin = rotary_angles(rotary, variant.rotary, q.dtype, rotary_scale(cfg, kind))
        rotate = lambda x: apply_rotary(x, cos, sin, cfg.rot_dim, self.style)
        norm = QK_NORMS[cfg.arch.qk_norm]
        # through ``attention``'s module attributes: the proof's controls plant there for every family
        q = attention.norm_then_rotary(q, norm(eps=cfg.norm_eps, name="q_norm"), rotate)
        k = attention.norm_then_rotary(k, norm(eps=cfg.norm_eps, name="k_norm"), rotate)
        v = value_normed(v, cfg.norm_eps) if cfg.value_norm else v
        if shared is not None:
            k, v, shared = read_shared(shared, k, v, kind if slot is None else slot, reuse)
        out, cache = self._attention(q, k, v, positions, cache, starts, kind, variant)
        return self._out(out, xf, None), shared, cache

    def _attention(self, q, k, v, positions, cache, starts, kind, variant):
        """(out [B, T, h, E], cache): the kinds' cache, a one-kind cache, cp or one device."""
        cfg = self.cfg
        if cache is not None and "index" in cache:
            attend = lambda q, k, v, key_pos, w: self._attend(
                q, k, v, positions, key_pos, starts, variant.replace(window=w)
            )
            return kinds_cache_attend(cfg, cache, q, k, v, positions, kind, attend)
        key_pos = positions
        if cache is not None:
            cache, key_pos = cache_update(cache, k, v, positions, cache_window(cfg))
            k, v = cache["k"].astype(q.dtype), cache["v"].astype(q.dtype)
        if self.par.context_parallel:
            kernel = dict(block=cfg.attn_block, blockwise=cfg.attention == "blockwise", variant=variant)
            kernel["flash"] = cfg.attention == "flash"  # the ring's steps by flash (``flash_ring``)
            k, v = attention.as_heads(k, q.shape[-1]), attention.as_heads(v, v.shape[-1] // q.shape[-1])
            return context_attention(q, k, v, positions, self.par, plain_attend=_attend, **kernel), cache
        return self._attend(q, k, v, positions, key_pos, starts, variant), cache


def router_input(residual, experts_in):
    """What Gemma 4's router reads: the residual stream, not the experts' normed input (a module
    attribute: the proof plants the other, ``proof.router_controls``)."""
    del experts_in
    return residual


def block(cfg, par, norm, mlp):
    """Gemma 4's layer: the sandwich block (``transformer._sandwich_layer``), then the per-layer input
    and the layer's scalar. (x, shared, positions, cache, starts, inp) -> (x, shared, cache, routing
    statistics [2E + 3] or None); ``inp`` its per-layer inputs {"kind", "reuse", "ple"} (``stack``).
    With experts (``Family.moe``: the 26B-A4B) the feed-forward is two branches, each normed before and
    after: the dense MLP and the experts (``model.moe``, routed on the residual), their sum normed."""

    def layer(x, shared, positions, cache, starts, inp):
        xf = par.f(norm("ln")(x))
        attention = SharedKVAttention(cfg=cfg, par=par, stddev=STDDEV)
        kind, slot = inp["kind"], inp.get("slot")
        attn, shared, cache = attention(xf, positions, cache, starts, kind, shared, inp["reuse"], slot)
        x = x + norm("post_attn_ln")(par.row_out(attn))
        out, b = mlp()(par.f(norm("ln2")(x)))
        out, stats = par.row_out(out, b), None
        if cfg.arch.moe:  # transformers' post_feedforward_layernorm_1, pre_/post_feedforward_layernorm_2
            xn = norm("moe_ln")(x)
            experts = MoE(cfg=cfg, par=par, stddev=STDDEV, dropping=cache is None)
            moe_out, stats = experts(xn, router_in=router_input(x, xn))
            out = norm("post_mlp_ln1")(out) + norm("post_moe_ln")(par.row_out(moe_out))
        x = x + norm("post_mlp_ln")(out)
        if cfg.ple_dim:
            x = PerLayerInput(cfg)(x, inp["ple"])
        if cfg.layer_scalar:  # transformers' buffer: fixed there, a parameter here (replicated)
            x = LayerScalar()(x)
        return x, shared, cache, stats

    return layer


def cache_index(cfg) -> np.ndarray:
    """[n_layers] int32: each layer's slice of its kind's cache (``kv_kinds.kind_index``); a reusing
    layer's is the slice of the last earlier layer of its kind, whose keys and values it reads."""
    kinds, index = attention.layer_kinds(cfg), kind_index(cfg).copy()
    for i in range(cfg.first_shared, cfg.n_layers):
        producer = max(j for j in range(cfg.first_shared) if kinds[j] == kinds[i])
        index[i] = index[producer]
    return index


def stack(cfg, par, make_layer, x, positions, cache, starts, ple):
    """The layer stack -> (x, cache, routing statistics [L, 2E + 3] or None): per-layer inputs each
    layer's kind, whether it reuses, its input slice and its cache index; the carry x, the shared keys
    and values and (generation with both kinds) the two-array cache (``kv_kinds``). ``make_layer(cfg)``:
    the layer of a config (global layers of their own shape run ``per_layer_runs.split_stack``, with
    the same arguments)."""
    layer, n = make_layer(cfg), cfg.n_layers
    kinds = attention.layer_kinds(cfg)
    inp = {
        "kind": jnp.asarray(np.zeros(n, np.int32) if kinds is None else kinds),
        "reuse": jnp.asarray(np.arange(n) >= cfg.first_shared),
        "ple": None if ple is None else in_layer_order(ple),
    }
    shared = _shared_init(cfg, par, x) if cfg.kv_shared_layers else None
    kinds_cache = cache is not None and "k_local" in cache
    if kinds_cache:
        inp["index"] = jnp.asarray(cache_index(cfg))

    def step(carry, one):
        x, shared, c = carry
        if kinds_cache:
            c = {**c, "index": one["index"]}
        elif cache is not None:
            c = one["cache"]
        x, shared, c, stats = layer(x, shared, positions, c, starts, one)
        if kinds_cache:
            return (x, shared, {name: c[name] for name in cache}), (None, stats)
        return (x, shared, None), (c, stats)

    if cache is not None and not kinds_cache:
        inp["cache"] = cache
    stacked = layer_stack(n, with_per_layer_inputs=True, unroll=cfg.layer_unroll, name="layers")
    carry = (x, shared, cache if kinds_cache else None)
    (x, _, kept), (out, stats) = stacked(remat_body(cfg.remat, step, layer_gathers(par)))(carry, inp)
    return x, (kept if kinds_cache else out), stats


def _shared_init(cfg, par, x, slots: int = 2):
    """The carry's keys and values {"k", "v": [slots, B, T, Kl, E]} before the first layer (a slot per
    kind; one per kind's own carry, ``per_layer_runs``): zeros typed as the keys will vary (over mp,
    where the heads are; and every axis x varies over)."""
    mp = par.layout.mp
    kl = cfg.kv_heads // mp if cfg.kv_heads % mp == 0 else 1
    zeros = jnp.zeros((slots, *x.shape[:2], kl, cfg.dim_per_head), x.dtype)
    return {name: varying_like(par.f(zeros), x) for name in ("k", "v")}
