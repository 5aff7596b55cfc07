"""An attention variant, declared once: the record every attention kernel takes and none of them names.

PyTorch FlexAttention's split, as data plus small functions: a *mask rule* says which keys a query may
see, a *score rule* what happens to a scaled score before the softmax; the block mask (which K/V blocks
the blockwise kernel may skip) is derived from the mask rules, never written per variant. Plain attention
(``attention._attend``), the blockwise kernel's forward and backward (``blockwise``), both cp strategies
(``context_parallel``), the KV-cache decode and the float64 reference take a ``Variant``; they call its
methods and pass ``Variant.rules()`` on to the mask hooks without reading it.

What a variant is made of:
  mask (what a query may see)   ``causal``; a sliding ``window`` (a Python int, or a layer's traced int32
                                scalar, 0 there: none); document starts (data, ``q_start``: per query).
                                A new rule (chunked attention: keys of the query's chunk only) is one more
                                keyword of ``mask_mod`` and of ``block_needed``, and one more entry of
                                ``rules()``: the kernels pass the keywords through.
  score (what happens to s)     the scale, 1 / sqrt(``scalar`` or head_dim) (Gemma's query_pre_attn_scalar:
                                folded into q for the kernels, ``query``), then ``softcap``'s c tanh(s / c)
                                (Gemma 2): ``score_mod`` and its slope for the backward, ``score_mod_slope``.
  normaliser (what joins the    ``finish``: applied once to the merged partial of all K/V sets (after the
  softmax's sum)                ring's log-sum-exp merge, never per step): learned ``sink`` logits (gpt-oss:
                                one per head, exp(sink) joins ``lsum``; no value), their gradient from the
                                final output and log-sum-exp (``cotangent``).
  rotary (which layers rotate)  ``rotary``: the layer's inverse frequencies (None: none, a NoPE layer).

A variant is a pytree (``window``, ``rotary`` and ``sink`` may be traced: its leaves; the rest static), so
it is an argument of the kernels' custom VJPs as it is.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from meshlm.model.layers import varying_like
from meshlm.model.rope import attention_scale


@dataclass(frozen=True)
class Variant:
    """One layer's attention variant (see the module's docstring for each part)."""

    window: Any = None  # mask: sliding window (int > 0, or a traced int32 scalar; None or 0: none)
    causal: bool = True  # mask: a query sees keys at or before its position
    softcap: float = 0.0  # score: c * tanh(s / c) before the mask (0: none)
    scalar: float = 0.0  # score: divided by sqrt(scalar) (0: by sqrt(head_dim))
    rotary: Any = None  # rotary: inverse frequencies [rot_dim / 2] (None: the layer is not rotated)
    sink: Any = None  # normaliser: learned logits [h] of this shard's query heads (None: none)
    chunk: Any = None  # mask: keys of the query's chunk only (int > 0, or a traced int32; None or 0: none)
    l2_qk: float = 0.0  # queries: the rotated layers' q and k heads L2-normed with this eps (0: none)
    temperature: tuple = ()  # queries: the NoPE layers' (floor_scale, attn_scale) (): none

    @classmethod
    def of(cls, cfg, heads: int, window=None, rotary=None, kind=None, learned=None) -> Variant:
        """The model's variant for one layer: its ``window`` and rotary frequencies (a layer kind's,
        ``attention.kind_tables``), the model's score rules (``attn_softcap``, ``attn_scalar``).
        ``heads``: the layer's query heads on this shard, the shape of the learned sinks (``attn_sinks``:
        made here, inside the attention module, by ``hk.get_parameter``: "attn/sinks" [H], split over mp
        with the heads). ``attn_chunk``: every layer's chunk, or with a traced ``kind`` the local layers'
        (Llama 4: chunked layers and global ones). ``learned``: the layer's attention parameters, where
        the caller is not Haiku (the bench's plain reference): the learned leaves are read from them."""
        sink = None
        if cfg.attn_sinks:
            sink = hk.get_parameter("sinks", [heads], init=jnp.zeros) if learned is None else learned["sinks"]
        chunk = cfg.attn_chunk or None
        if chunk and kind is not None:
            chunk = jnp.where(kind == 0, jnp.int32(chunk), 0)
        rules = dict(window=window, chunk=chunk, rotary=rotary, sink=sink)
        queries = dict(l2_qk=cfg.norm_eps if cfg.qk_l2_norm else 0.0, temperature=temperature(cfg))
        return cls(softcap=cfg.attn_softcap, scalar=cfg.attn_scalar, **rules, **queries)

    def queries(self, q, k, positions):
        """Llama 4's rules on the rotated q and k, before any kernel or cache (``query_rules``)."""
        return query_rules(self, q, k, positions)

    def replace(self, **fields) -> Variant:
        return dataclasses.replace(self, **fields)

    # ---- mask ----

    def rules(self) -> dict:
        """The mask rules' keywords beyond causality for ``mask_mod`` / ``block_needed`` (and the
        kernels' ``_visible`` / ``_needed``, where the controls plant): only the rules that are on, so
        a variant without them runs the program it ran before they existed."""
        on = lambda v: v is not None and not (isinstance(v, int) and not v)
        return {name: v for name, v in (("window", self.window), ("chunk", self.chunk)) if on(v)}

    def for_kernel(self, like=None) -> Variant:
        """The variant as the kernels' custom VJPs take it: a Python window an int32 scalar (a primal,
        cotangent None), a Python 0 none (the program is as without one); a sink typed as varying like
        ``like`` (the queries: inside shard_map its cotangent then varies as theirs, and the transpose of
        that cast, outside the kernel, sums it over the data and cp shards, as any parameter's)."""
        rules = {name: jnp.asarray(v, jnp.int32) for name, v in self.rules().items()}
        sink = self.sink if self.sink is None or like is None else varying_like(self.sink, like)
        return self.replace(window=rules.get("window"), chunk=rules.get("chunk"), rotary=None, sink=sink)

    # ---- score ----

    def query(self, q):
        """q as the blockwise kernel and the cp strategies take it: they divide the scores by sqrt(E);
        with ``scalar`` q is multiplied by sqrt(E / scalar) first, so the scores are divided by
        sqrt(scalar), as plain attention's."""
        if not self.scalar:
            return q
        return q * jnp.asarray(np.sqrt(q.shape[-1] / self.scalar), q.dtype)

    def folded(self) -> Variant:
        """The variant once ``query`` has folded its scale into q (plain attention on a pre-scaled q)."""
        return self.replace(scalar=0.0)

    def score(self, s):
        """The scaled scores as the softmax meets them (before the mask): ``score_mod``."""
        return score_mod(s, self)

    def score_slope(self, s):
        """d score / d s at the unmodified scores s (the backward's chain rule): ``score_mod_slope``."""
        return score_mod_slope(s, self)

    # ---- normaliser ----

    def finish(self, part):
        """The merged partial of every K/V set (a ``blockwise.Partial``: out [B, Tq, H, E], m, lsum [B,
        Tq, H]) with exp(sink) [H] in its normaliser: applied once, after the last merge."""
        if self.sink is None:
            return part
        sink = self.sink.astype(part.m.dtype)
        m = jnp.maximum(part.m, sink)  # (-inf where no key is visible: the sink's alone)
        kept = part.lsum * jnp.exp(part.m - m)
        lsum = kept + jnp.exp(sink - m)
        return type(part)(part.out * (kept / lsum)[..., None].astype(part.out.dtype), m, lsum)

    def finish_probs(self, probs, scores, visible):
        """Plain attention's probabilities [B, K, G, Tq, S] (the softmax of the scaled ``scores`` through
        ``score``, where ``visible``; head K x G + G's sink) with exp(sink) in the normaliser."""
        if self.sink is None:
            return probs
        s = jnp.where(visible, self.score(scores), -jnp.inf)
        sink = self.sink.astype(s.dtype).reshape(*s.shape[1:3])[None, :, :, None]  # [1, K, G, 1]
        m = jnp.maximum(jnp.max(s, axis=-1), sink)
        kept = jnp.sum(jnp.exp(s - m[..., None]), axis=-1)
        return probs * (kept / (kept + jnp.exp(sink - m)))[..., None]

    def cotangent(self, out, lse, dout):
        """The kernels' backward for the variant's own leaves (None where none is learned): the sinks',
        -sum over (B, Tq) of p_sink (dout . out), p_sink = exp(sink - lse) [B, Tq, H], from the final
        ``out`` [B, Tq, H, E] and ``lse`` (which holds the sink); the softmax's other columns, the
        kernels' dS = P (dP - D), are unchanged (the sink has no value: its dP is 0)."""
        if self.sink is None:
            return None
        d = jnp.sum(dout.astype(lse.dtype) * out.astype(lse.dtype), axis=-1)
        dsink = -jnp.sum(jnp.exp(self.sink.astype(lse.dtype) - lse) * d, axis=(0, 1))
        return self.replace(window=None, chunk=None, rotary=None, sink=dsink.astype(self.sink.dtype))


jax.tree_util.register_dataclass(
    Variant,
    data_fields=["window", "rotary", "sink", "chunk"],
    meta_fields=["causal", "softcap", "scalar", "l2_qk", "temperature"],
)


CAUSAL = Variant()  # plain causal attention: no window, no score rule


def variant_of(variant: Variant | None = None, **fields) -> Variant:
    """``variant``, or a ``Variant`` of ``fields`` (a one-off call: ``window=``, ``causal=``, ...)."""
    if variant is None:
        return Variant(**fields)
    if fields:
        raise TypeError(f"pass either a variant or its fields, not both: {sorted(fields)}")
    return variant


# ---- the score rule ----


def soft_cap(x, cap: float):
    """Gemma 2's soft-capping, ``cap * tanh(x / cap)`` (transformers' order: divide, tanh, multiply);
    ``cap`` 0: x unchanged. Also the output logits' cap (``capped_logits``)."""
    return x if not cap else jnp.tanh(x / cap) * cap


def score_mod(s, variant: Variant):
    """The kernels' score rule: the scaled scores soft-capped, before the mask and the online softmax."""
    return soft_cap(s, variant.softcap)


def score_mod_slope(s, variant: Variant):
    """d score_mod / d s at the unmodified scores s, 1 - tanh(s / cap)^2 (dS of the modified scores
    times this is dS of the scores); no modification: 1."""
    return 1.0 if not variant.softcap else 1.0 - jnp.square(jnp.tanh(s / variant.softcap))


def capped_logits(cfg, logits):
    """The output logits soft-capped (``final_softcap``; elementwise: any vocab slice)."""
    return soft_cap(logits, cfg.final_softcap)


# The score rules' config fields, their transformers config.json names (Gemma 2's) and what they are: an
# export to a family whose config.json has no such field refuses a non-zero value (``io.hf_config``).
def query_rules(variant: Variant, q, k, positions):
    """Llama 4's rules on the rotated q, k [B, T, h, E] (before any kernel or cache): each head
    L2-normed on the rotated layers (``l2_qk``, in at least float32), and on the others the queries
    times the temperature log1p(floor((p + 1) / floor_scale)) attn_scale + 1 at absolute position p
    [B, T]. A layer is rotated where its ``rotary`` frequencies are not all zero (NoPE's are)."""
    if not (variant.l2_qk or variant.temperature):
        return q, k
    rotated = False if variant.rotary is None else jnp.any(jnp.asarray(variant.rotary) != 0)
    if variant.l2_qk:
        wide = lambda x: x.astype(jnp.promote_types(x.dtype, jnp.float32))
        l2 = lambda x: wide(x) * jax.lax.rsqrt(jnp.mean(wide(x) ** 2, -1, keepdims=True) + variant.l2_qk)
        q, k = (jnp.where(rotated, l2(x).astype(x.dtype), x) for x in (q, k))
    if variant.temperature:
        floor, scale = variant.temperature
        p = positions.astype(jnp.promote_types(q.dtype, jnp.float32))
        t = jnp.log1p(jnp.floor((p + 1.0) / floor)) * scale + 1.0  # [B, T]
        q = jnp.where(rotated, q, (q * t[..., None, None]).astype(q.dtype))
    return q, k


def temperature(cfg) -> tuple:
    """Llama 4's NoPE-layer temperature (floor_scale, attn_scale), or () where off (``Variant.queries``)."""
    return (cfg.attn_floor_scale, cfg.attn_temp_scale) if cfg.attn_floor_scale else ()


def rotary_scale(cfg, kind=None):
    """What a layer's cos and sin are multiplied by (YaRN's attention factor, ``rope.attention_scale``;
    1 otherwise). With a traced layer ``kind`` (0 local): a NoPE layer's 1 (it is not rotated), a local
    layer's 1 unless its rotary is the global one's (``Family.rope_scales_local``: gpt-oss, SmolLM3),
    as transformers' rotary per layer type (OLMo 3: YaRN on the full layers only). A Python float where
    both kinds agree."""
    scale = attention_scale(cfg.rope_scaling)
    if kind is None:
        return scale
    local = scale if cfg.arch.rope_scales_local else 1.0
    full = 1.0 if cfg.global_nope else scale
    if isinstance(kind, int):  # a Python kind (a run of one kind, the hand-written model): a Python float
        return local if kind == 0 else full
    return local if local == full else jnp.where(kind == 0, local, full)


def global_rotated(cfg):
    """The global layers' frequencies are multiplied by this (``attention.kind_tables``): 0 on NoPE layers,
    else 1 on the first ``rope_global_fraction`` of the pairs, 0 on the others (Gemma 4's "proportional")."""
    if cfg.global_nope:
        return 0.0
    if not cfg.rope_global_fraction:
        return 1.0
    pairs = cfg.rot_dim // 2
    return (np.arange(pairs) < int(cfg.rope_global_fraction * cfg.rot_dim // 2)).astype(np.float64)


EXPORTED_AS = {
    "attn_softcap": ("attn_logit_softcapping", "soft-capping"),
    "final_softcap": ("final_logit_softcapping", "soft-capping"),
}


# ---- the mask rules, and the block mask derived from them ----


def mask_mod(qp, kp, causal: bool, qs=None, *, window=None, chunk=None):
    """Which (query, key) pairs are visible, by absolute positions (broadcast against each other):
    causal, keys at or before the query; ``qs`` (``--doc-mask``), keys at or after the query's
    document start; ``window``, keys with ``qp - window < kp`` (a traced 0: no window); ``chunk``
    (Llama 4), keys of the query's chunk, ``kp // chunk == qp // chunk`` (a traced 0: none). Python
    True where no rule applies."""
    vis = kp <= qp if causal else True
    if window is not None:
        w = jnp.asarray(window, qp.dtype)
        vis = vis & ((w == 0) | (kp > qp - w))
    if chunk is not None:
        c = jnp.asarray(chunk, qp.dtype)
        c1 = jnp.maximum(c, 1)
        vis = vis & ((c == 0) | (kp // c1 == qp // c1))
    return vis if qs is None else vis & (kp >= qs)


def block_needed(qp, kp, kvalid, causal: bool, qs=None, *, window=None, chunk=None):
    """Scalar: whether a query block (positions ``qp`` [B, bq]) meets a visible key of a K/V block
    (``kp``, ``kvalid`` [B, bk]), derived from ``mask_mod``'s rules, each a lowest visible key that
    grows with the query: causal, the block's first key at or before its last query; document starts,
    its last key at or after the block's first start; a window, its last key inside the first query's
    window (per query O(window / block) blocks are computed); a chunk, its last key at or after the
    first query's chunk start (every block outside the query block's chunks is skipped)."""
    if not causal:
        return jnp.any(kvalid)
    imax, imin = jnp.iinfo(kp.dtype).max, jnp.iinfo(kp.dtype).min
    first_key = jnp.min(jnp.where(kvalid, kp, imax), axis=-1)  # [B]
    needed = first_key <= jnp.max(qp, axis=-1)
    last_key = jnp.max(jnp.where(kvalid, kp, imin), axis=-1)
    if qs is not None:
        needed = needed & (last_key >= jnp.min(qs, axis=-1))
    if window is not None or chunk is not None:  # padded query rows (imin) left out of the first query
        first_query = jnp.min(jnp.where(qp == imin, imax, qp), axis=-1)
    if window is not None:
        w = jnp.asarray(window, qp.dtype)  # 0: no window (as in ``mask_mod``)
        needed = needed & ((w == 0) | (last_key > first_query - w))
    if chunk is not None:
        c = jnp.asarray(chunk, qp.dtype)
        needed = needed & ((c == 0) | (last_key >= first_query - first_query % jnp.maximum(c, 1)))
    return jnp.any(needed)
