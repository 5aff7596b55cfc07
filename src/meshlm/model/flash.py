"""Fused flash attention on TPU: JAX's own Pallas splash-attention kernel (``--attention flash``).

``jax.experimental.pallas.ops.tpu.splash_attention`` computes softmax attention block by block in one
Pallas kernel, forward and backward (its own custom VJP), memory O(T). On a TPU it is compiled (Mosaic);
elsewhere (CPU, where CI runs) the same kernel runs in Pallas interpret mode (``interpret=True``), so
every test exercises the kernel's own code, not a stand-in.

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
- the score: the 1 / sqrt(scalar or E) scale folded into q, then soft-capping (``attn_logits_soft_cap``:
  c tanh(s / c) before the mask, as ``score_mod``);
- the normaliser: learned sinks (``sinks``: exp(sink) joins the softmax's sum, one logit per query head;
  the kernel's backward returns their gradient);
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

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import config as jax_config  # shard_map's own switch of vma checking: see ``_unchecked``
from jax._src import dispatch
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
from jax.extend.core import Primitive
from jax.interpreters import mlir

from meshlm.model.attention_variants import CAUSAL, Variant
from meshlm.model.layers import varying_like

LANES = 128  # the kernel's blocks are multiples of this many tokens
BLOCKS = (512, 256, 128)  # tried in order: the largest that divides the padded length


def interpret_mode() -> bool:
    """Pallas interpret mode everywhere but on a TPU (the compiled kernel is Mosaic, TPU only)."""
    return jax.default_backend() != "tpu"


def padded_length(t: int) -> int:
    """T rounded up to the kernel's multiple of 128 tokens."""
    return -(-t // LANES) * LANES


def block_size(t_padded: int) -> int:
    """Queries and keys per kernel block: the largest of ``BLOCKS`` that divides the padded length."""
    return next(b for b in BLOCKS if t_padded % b == 0)


def _mask(t: int, window: int, chunk: int) -> masks.Mask:
    """One head's [T, T] mask (static, by token index): causal, inside the window, inside the chunk."""
    mask = masks.CausalMask((t, t))
    if window:  # a query at i sees i - window < j <= i: window - 1 keys before it, itself
        mask = masks.LocalMask((t, t), (window - 1, 0), 0)
    if chunk:
        chunked = masks.ChunkedCausalMask((t, t), chunk)
        mask = chunked if not window else mask & chunked
    return mask


@functools.lru_cache(maxsize=64)
def _kernel(heads: int, t: int, window: int, chunk: int, softcap: float, interpret: bool, mask_of=None):
    """The splash kernel for ``heads`` query heads of one sequence of ``t`` (padded) tokens; its mask
    information is computed once per shape and rule (numpy), hence the cache. ``mask_of``: the mask
    builder (``_mask``, as the caller traced it: a planted one is a kernel of its own)."""
    b = block_size(t)
    sizes = splash.BlockSizes(
        block_q=b, block_kv=b, block_kv_compute=b,
        block_q_dkv=b, block_kv_dkv=b, block_kv_dkv_compute=b,
        block_q_dq=b, block_kv_dq=b,
    )  # fmt: skip
    mask = masks.MultiHeadMask([(mask_of or _mask)(t, window, chunk)] * heads)
    with jax.ensure_compile_time_eval():  # its mask arrays constants, not the caller's trace's (cached)
        return splash.make_splash_mha(
            mask,
            block_sizes=sizes,
            head_shards=1,
            q_seq_shards=1,
            attn_logits_soft_cap=softcap or None,
            interpret=interpret,
        )


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


def _rule_kernel(q, rule):
    """The kernel of ``rule`` (window, chunk, soft-cap, mask builder) for q [B, h, Tp, E]."""
    window, chunk, softcap, mask_of = rule
    return _kernel(q.shape[1], q.shape[2], window, chunk, float(softcap), interpret_mode(), mask_of)


def _ids(seg):
    return None if seg is None else splash.SegmentIds(q=seg, kv=seg)


def _collapsed(info):
    """A mask's information as splash's own entry point hands it to the kernels (its partial mask
    blocks [heads, q blocks, kv blocks, bq, bkv] as one leading axis)."""
    if info is None or info.partial_mask_blocks is None:
        return info
    blocks = info.partial_mask_blocks
    return info._replace(partial_mask_blocks=blocks.reshape(-1, *blocks.shape[-2:]))


def _forward(q, k, v, segments, sink, rule):
    """q [B, h, Tp, E], k, v [B, kv, Tp, E] (padded, q scaled) -> (out [B, h, Tp, E], log-sum-exp
    [B, h, Tp] float32): the kernel with its residuals, one sequence at a time (``vmap``)."""
    kernel = _rule_kernel(q, rule)
    kernel = splash.SplashAttentionKernel(
        kernel.fwd_mask_info,
        kernel.dq_mask_info,
        kernel.dkv_mask_info,
        **{**kernel.kwargs, "save_residuals": True},
    )

    def one(q, k, v, seg):
        out, (lse,) = kernel(q, k, v, _ids(seg), sink)
        return out, lse

    return jax.vmap(one, in_axes=(0, 0, 0, None if segments is None else 0))(q, k, v, segments)


def _backward(q, k, v, segments, sink, out, lse, dout, rule):
    """The kernel's own backward (its dq and dkv kernels) from the forward's residuals, out and lse:
    (dq, dk, dv, dsink or None). Called as splash's custom VJP calls it (``_splash_attention_bwd``, its
    private half: the public kernel recomputes the forward to differentiate)."""
    kernel = _rule_kernel(q, rule)
    kw = kernel.kwargs
    infos = (_collapsed(kernel.dq_mask_info), _collapsed(kernel.dkv_mask_info))
    static = [
        kw[n] for n in ("mask_value", "is_mqa", "block_sizes", "residual_checkpoint_name", "mask_function")
    ]
    static += [kw["attn_logits_soft_cap"], kw["interpret"]]

    def one(q, k, v, seg, out, lse, dout):
        res = (q, k, v, _ids(seg), sink, out, lse, *infos)
        grads = splash._splash_attention_bwd(False, *static, res, dout)
        return grads[3], grads[4], grads[5], grads[7]

    axes = (0, 0, 0, None if segments is None else 0, 0, 0, 0)
    dq, dk, dv, dsink = jax.vmap(one, in_axes=axes)(q, k, v, segments, out, lse, dout)
    return dq, dk, dv, None if dsink is None else jnp.sum(dsink, axis=0)  # the sinks: summed over B


def _unchecked():
    """A region where shard_map's varying-axes (vma) typing is off, as ``shard_map(check_vma=False)``
    sets it: the splash kernel's ``pallas_call`` declares outputs without varying axes, which
    ``shard_map(check_vma=True)`` (every meshlm step) refuses (see ``_fwd_p``)."""
    return jax_config._check_vma(False)


def _split(args, has_seg: bool):
    """(q, k, v, segments or None, sink or None) from a primitive's operands."""
    q, k, v, *rest = args
    seg = rest.pop(0) if has_seg else None
    return q, k, v, seg, (rest[0] if rest else None)


def _fwd_impl(*args, rule, has_seg):
    with _unchecked():
        return _forward(*_split(args, has_seg), rule)


def _bwd_impl(*args, rule, has_seg):
    *args, out, lse, dout = args
    with _unchecked():
        grads = _backward(*_split(args, has_seg), out, lse, dout, rule)
    return [g for g in grads if g is not None]


def _primitive(name, impl, abstract, multiple_results):
    p = Primitive(name)
    p.multiple_results = multiple_results
    p.def_impl(functools.partial(dispatch.apply_primitive, p))
    p.def_abstract_eval(abstract)
    mlir.register_lowering(p, mlir.lower_fun(impl, multiple_results=multiple_results))
    return p


# The kernel as two primitives, forward and backward, opaque to every transformation: their results are
# typed here, as shard_map(check_vma=True) types them (varying like q, which every operand is cast to
# first: ``_bridge``), and only their lowering traces the kernel, inside ``_unchecked``. (Traced inline,
# its equations would be re-traced with the typing on by remat or the layer scan's partial evaluation.)
# No collective is added or dropped: the kernel is per shard, this shard's heads and batch rows.
_fwd_p = _primitive(
    "meshlm_flash_fwd",
    _fwd_impl,
    lambda q, *_, **__: [q, q.update(shape=q.shape[:3], dtype=jnp.float32)],
    True,
)


def _bwd_avals(*avals, rule, has_seg):  # the gradients typed as q, k, v (and the sinks)
    ops = avals[:-3]
    return [*ops[:3], *ops[3 + has_seg :]]


_bwd_p = _primitive("meshlm_flash_bwd", _bwd_impl, _bwd_avals, True)


def _bridge_fwd(rule, q, k, v, segments, sink):
    ops = [x for x in (q, k, v, segments, sink) if x is not None]
    out, lse = _fwd_p.bind(*ops, rule=rule, has_seg=segments is not None)
    return out, (q, k, v, segments, sink, out, lse)


def _bridge_bwd(rule, res, dout):
    *res, out, lse = res
    ops = [x for x in res if x is not None]
    dq, dk, dv, *dsink = _bwd_p.bind(*ops, out, lse, dout, rule=rule, has_seg=res[3] is not None)
    return dq, dk, dv, None, (dsink[0] if dsink else None)


def _bridge(rule, q, k, v, segments, sink):
    """``_one_rule`` through the two primitives (``rule``: window, chunk, soft-cap, mask builder);
    every operand typed as varying like q (the casts' transposes, outside, sum what they must)."""
    return _bridge_fwd(rule, q, k, v, segments, sink)[0]


_bridge = jax.custom_vjp(_bridge, nondiff_argnums=(0,))
_bridge.defvjp(_bridge_fwd, _bridge_bwd)


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
    takes (``layer_rules``)."""
    b, t, h, e = q.shape
    tp = padded_length(t)
    scale = 1.0 / np.sqrt(variant.scalar or e)
    pad = lambda x: jnp.pad(jnp.swapaxes(x, 1, 2), ((0, 0), (0, 0), (0, tp - t), (0, 0)))
    qp, kp, vp = pad(q * jnp.asarray(scale, q.dtype)), pad(k), pad(v)
    segments = None if q_start is None else _segments(q_start, tp)
    sink = None if variant.sink is None else variant.sink.astype(jnp.float32)
    # every operand varying as q does (``_bridge``): K/V replicated over mp, sinks over dp, ...
    kp, vp, segments, sink = (None if x is None else varying_like(x, qp) for x in (kp, vp, segments, sink))
    # the rule a primitive's parameter: the mask builder looked up now, as the program is traced
    run = lambda rule: lambda *a: _bridge((*rule, float(variant.softcap), _mask), *a)
    args = (qp, kp, vp, segments, sink)
    rule = static_rules(variant)
    if rule is not None:
        out = run(rule)(*args)
    else:
        out = lax.switch(_rule_index(variant, candidates), [run(c) for c in candidates], *args)
    return jnp.swapaxes(out[:, :, :t], 1, 2).astype(q.dtype)
