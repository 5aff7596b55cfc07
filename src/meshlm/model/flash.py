"""Fused flash attention on TPU: JAX's own Pallas splash-attention kernel (``--attention flash``).

``jax.experimental.pallas.ops.tpu.splash_attention`` computes softmax attention block by block in
Pallas kernels, memory O(T): a forward kernel that also returns each row's log-sum-exp, and a dq and a
dkv kernel for the backward, which start from the forward's output and log-sum-exp (no forward is
recomputed). On a TPU they are compiled (Mosaic); elsewhere (CPU, where CI runs) the same kernels run
in Pallas interpret mode (``interpret=True``), so every test exercises the kernel's own code, not a
stand-in. This module maps a ``Variant`` to the kernel's parameters; ``flash_kernel`` runs the kernel
(inside ``shard_map`` too).

Shapes (as ``attention._attend``, per shard): q [B, T, h, E]; k, v [B, T, kv, E] with h a multiple of kv
(grouped-query: query head i reads KV head i // (h / kv), which is splash's own MHA grouping, so K/V
are neither repeated nor copied). The kernel takes one sequence, [heads, T, E]: the batch is a
``vmap`` and the heads are transposed in front of the sequence.

What the kernel is told of a ``Variant`` (it never learns the variant's name):

- the mask, by token index (the queries and keys are one sequence at positions 0..T-1: training,
  scoring; ``Attention._attend`` sends a KV-cache decode, whose keys are the cache's slots, to plain
  attention): causal (``CausalMask``), a sliding window w (``LocalMask`` with w - 1 keys to the left,
  none to the right: a query at i sees i - w < j <= i), Llama 4's chunks (``ChunkedCausalMask``), the
  two together (their ``&``); document starts (``--doc-mask``) as segment ids: a key j is visible to a
  query i >= j of the same document exactly when both tokens' document starts are equal;
- the score: the 1 / sqrt(scalar or E) scale folded into q; the variant's score rule and learned
  normaliser become the kernel's own parameters in one place, ``flash_kernel.kernel_rule`` and
  ``flash_kernel.kernel_normaliser`` (the one module that names them: the boundary to JAX's kernel);
- a layer's traced window or chunk (Gemma 2/3's, gpt-oss's, Llama 4's local and global layers in one
  layer loop): the kernel's masks are static, so each candidate of the model's ``layer_rules`` is
  compiled once and ``lax.switch`` picks the traced layer's.

Sequence length: the kernel's blocks are multiples of 128 tokens. T is padded at the end to a multiple
of 128 (the blocks then 512, 256 or 128, the largest that divides it): a padded key comes after every
real query, so causality hides it; padded query rows are dropped. Nothing else changes with T.

Precision: the kernel keeps its running max, sum and accumulator in float32 and multiplies in float32
at most: float64 inputs are not computed in float64 (``meshlm verify --x64`` refuses flash in one line;
float32 verify proves it at the float32 tolerance).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

from meshlm.model.attention_variants import CAUSAL, Variant
from meshlm.model.flash_kernel import LANES, bridge, kernel_normaliser, kernel_rule
from meshlm.model.layers import varying_like


def padded_length(t: int) -> int:
    """T rounded up to the kernel's multiple of 128 tokens."""
    return -(-t // LANES) * LANES


def _mask(t: int, window: int, chunk: int) -> masks.Mask:
    """One head's [T, T] mask (static, by token index): causal, inside the window, inside the chunk."""
    mask = masks.CausalMask((t, t))
    if window:  # a query at i sees i - window < j <= i: window - 1 keys before it, itself
        mask = masks.LocalMask((t, t), (window - 1, 0), 0)
    if chunk:
        chunked = masks.ChunkedCausalMask((t, t), chunk)
        mask = chunked if not window else mask & chunked
    return mask


def static_rules(variant: Variant) -> tuple[int, int]:
    """(window, chunk) of a variant whose rules are Python ints (0: off); None if one is traced."""
    rules = variant.rules()
    values = [rules.get(name, 0) for name in ("window", "chunk")]
    if not all(isinstance(v, int | np.integer) for v in values):
        return None
    return int(values[0]), int(values[1])


def layer_rules(cfg) -> tuple[tuple[int, int], ...]:
    """The (window, chunk) a layer of ``cfg`` may have (its kinds': ``attention.kind_tables``): local
    layers the sliding window and the chunk, global ones neither."""
    local = (cfg.sliding_window, cfg.attn_chunk)
    return (local, (0, 0)) if cfg.global_every else (local,)


def _segments(starts, t_padded: int):
    """[B, T] document starts -> [B, T padded] int32 segment ids (padded tokens: one id of their own)."""
    ids = starts.astype(jnp.int32)
    return jnp.pad(ids, ((0, 0), (0, t_padded - ids.shape[1])), constant_values=t_padded)


def _rule_index(variant: Variant, candidates) -> jax.Array:
    """The index in ``candidates`` of the traced (window, chunk) of ``variant`` (int32 scalar)."""
    rules = variant.rules()
    window, chunk = (jnp.asarray(rules.get(name, 0), jnp.int32) for name in ("window", "chunk"))
    hits = [(window == w) & (chunk == c) for w, c in candidates]
    return jnp.argmax(jnp.stack(hits)).astype(jnp.int32)


def flash_attention(q, k, v, q_start=None, variant: Variant = CAUSAL, *, candidates=((0, 0),)):
    """Causal grouped softmax attention of one sequence's tokens, q [B, T, h, E], k, v [B, T, kv, E]
    (this shard's heads) -> [B, T, h, E] in q's dtype, by the splash kernel. ``q_start`` [B, T]
    (``--doc-mask``): where each token's document starts. ``variant``: the mask and score rules;
    where its window or chunk is traced, ``candidates`` lists the static (window, chunk) pairs it
    takes (``layer_rules``: a traced value not among them would run the first one's mask)."""
    if not variant.causal:  # every meshlm model is causal; the splash masks here are built causal
        raise ValueError("flash_attention is causal attention only; use plain or blockwise attention")
    b, t, h, e = q.shape
    tp = padded_length(t)
    scale = 1.0 / np.sqrt(variant.scalar or e)
    pad = lambda x: jnp.pad(jnp.swapaxes(x, 1, 2), ((0, 0), (0, 0), (0, tp - t), (0, 0)))
    qp, kp, vp = pad(q * jnp.asarray(scale, q.dtype)), pad(k), pad(v)
    segments = None if q_start is None else _segments(q_start, tp)
    extra = kernel_normaliser(variant)  # [h] float32, or None
    # every operand varying as q does (``flash_kernel.bridge``): K/V replicated over mp, the normaliser's
    # logits over dp, ...
    kp, vp, segments, extra = (None if x is None else varying_like(x, qp) for x in (kp, vp, segments, extra))
    # the rule a primitive's parameter: the mask builder looked up now, as the program is traced
    run = lambda rule: lambda *a: bridge(kernel_rule(variant, *rule, _mask), *a)
    args = (qp, kp, vp, segments, extra)
    rule = static_rules(variant)
    if rule is not None:
        out = run(rule)(*args)
    else:
        out = lax.switch(_rule_index(variant, candidates), [run(c) for c in candidates], *args)
    return jnp.swapaxes(out[:, :, :t], 1, 2).astype(q.dtype)
