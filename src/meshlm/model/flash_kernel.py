"""JAX's Pallas splash-attention kernels run for ``model.flash``, inside ``shard_map`` too.

Inside ``shard_map(check_vma=True)`` (every meshlm step) the kernels cannot be traced inline: their
``pallas_call`` declares outputs without varying mesh axes. So the forward and the backward are each
one primitive of this module (``_fwd_p``, ``_bwd_p``, joined by a custom VJP, ``bridge``), typed as
varying like q, and only their lowering traces the kernels, as the per-device program they are
(``_per_device``: operands typed without mesh axes). No collective is added or dropped: the kernel is
per shard, this shard's heads and batch rows.

Private to ``model.flash``: it passes q [B, h, Tp, E] (scaled, padded to a multiple of ``LANES``), k, v
[B, kv, Tp, E], the segment ids [B, Tp] or None, the sinks [h] or None, and a rule (window, chunk,
soft-cap, mask builder: ``flash._mask``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax._src import config as jax_config  # the varying-axes check's switch: see ``_per_device``
from jax._src import core as jax_core  # ManualAxisType: see ``_untyped``
from jax._src import dispatch
from jax.ad_checkpoint import checkpoint_name
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
from jax.extend.core import Primitive
from jax.interpreters import mlir

from meshlm.parallel.compile_target import compile_platform

ATTN_OUT = "attn_out"  # the name --remat save_qkv_attn saves (``model.memory``)

LANES = 128  # the kernel's blocks are multiples of this many tokens
BLOCKS = (1024, 512, 256, 128)  # tried in order: the largest that divides the padded length
COMPUTE_BLOCK = 512  # keys a kernel step computes on (of its block)


def interpret_mode() -> bool:
    """Pallas interpret mode everywhere but on a TPU (the compiled kernel is Mosaic, TPU only): the
    platform compiled for, which ``meshlm plan --chip`` sets to a TPU from any host."""
    return compile_platform() != "tpu"


def block_size(t_padded: int) -> int:
    """Queries and keys per kernel block: the largest of ``BLOCKS`` that divides the padded length."""
    return next(b for b in BLOCKS if t_padded % b == 0)


@functools.lru_cache(maxsize=64)
def _kernel(heads: int, t: int, window: int, chunk: int, softcap: float, interpret: bool, mask_of):
    """The splash kernel for ``heads`` query heads of one sequence of ``t`` (padded) tokens; its mask
    information is computed once per shape and rule (numpy), hence the cache. ``mask_of``: the mask
    builder (``flash._mask``, as the caller traced it: a planted one is a kernel of its own)."""
    b = block_size(t)
    c = min(b, COMPUTE_BLOCK)
    sizes = splash.BlockSizes(
        block_q=b, block_kv=b, block_kv_compute=c,
        block_q_dkv=b, block_kv_dkv=b, block_kv_dkv_compute=c,
        block_q_dq=None, block_kv_dq=None, use_fused_bwd_kernel=True,
    )  # fmt: skip
    mask = masks.MultiHeadMask([mask_of(t, window, chunk)] * heads)
    with jax.ensure_compile_time_eval():  # its mask arrays constants, not the caller's trace's (cached)
        return splash.make_splash_mha(
            mask,
            block_sizes=sizes,
            head_shards=1,
            q_seq_shards=1,
            attn_logits_soft_cap=softcap or None,
            interpret=interpret,
        )


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


def _split(args, has_seg: bool):
    """(q, k, v, segments or None, sink or None) from a primitive's operands."""
    q, k, v, *rest = args
    seg = rest.pop(0) if has_seg else None
    return q, k, v, seg, (rest[0] if rest else None)


def _fwd_impl(*args, rule, has_seg):
    return _forward(*_split(args, has_seg), rule)


def _bwd_impl(*args, rule, has_seg):
    *args, out, lse, dout = args
    grads = _backward(*_split(args, has_seg), out, lse, dout, rule)
    return [g for g in grads if g is not None]


def _untyped(aval):
    """``aval`` without the mesh axes it varies over: a value as a per-device program sees it."""
    return (
        aval.update(manual_axis_type=jax_core.ManualAxisType()) if hasattr(aval, "manual_axis_type") else aval
    )


def _per_device(impl, multiple_results: bool):
    """The lowering of ``impl``: the per-device program it is, traced on the operands' shapes and dtypes
    alone (no mesh axes in their types) and without the varying-axes check, which has nothing to check
    there. Why: inside ``shard_map(check_vma=True)`` JAX's ``pallas_call`` wants each output typed with
    the mesh axes it varies over (``ShapeDtypeStruct.manual_axis_type``), and JAX 0.10.2's splash module
    declares none. The check stays on everywhere it has something to type: the primitives' results
    (``_fwd_p``, ``_bwd_p``) carry q's axes, and no collective can run inside (no operand has an axis)."""
    lowered = mlir.lower_fun(impl, multiple_results=multiple_results)

    def rule(ctx, *args, **params):
        ctx = ctx.replace(
            avals_in=[_untyped(a) for a in ctx.avals_in], avals_out=[_untyped(a) for a in ctx.avals_out]
        )
        with jax_config._check_vma(False):  # the per-device kernel: no axis in any type (above)
            return lowered(ctx, *args, **params)

    return rule


def primitive(name, impl, abstract, multiple_results):
    """A primitive typed by ``abstract`` whose lowering is ``impl`` traced per device (``_per_device``):
    a Pallas kernel inside ``shard_map(check_vma=True)`` (here and ``model.cache_kernel``)."""
    p = Primitive(name)
    p.multiple_results = multiple_results
    p.def_impl(functools.partial(dispatch.apply_primitive, p))
    p.def_abstract_eval(abstract)
    mlir.register_lowering(p, _per_device(impl, multiple_results))
    return p


# The kernel as two primitives, forward and backward, opaque to every transformation: their results are
# typed here, as shard_map(check_vma=True) types them (varying like q, which every operand is cast to
# first: ``bridge``), and only their lowering traces the kernel, per device (``_per_device``). (Traced inline,
# its equations would be re-traced with the typing on by remat or the layer scan's partial evaluation.)
# No collective is added or dropped: the kernel is per shard, this shard's heads and batch rows.
_fwd_p = primitive(
    "meshlm_flash_fwd",
    _fwd_impl,
    lambda q, *_, **__: [q, q.update(shape=q.shape[:3], dtype=jnp.float32)],
    True,
)


def _bwd_avals(*avals, rule, has_seg):  # the gradients typed as q, k, v (and the sinks)
    ops = avals[:-3]
    return [*ops[:3], *ops[3 + has_seg :]]


_bwd_p = primitive("meshlm_flash_bwd", _bwd_impl, _bwd_avals, True)


def kernel_rule(variant, window: int, chunk: int, mask_of) -> tuple:
    """A primitive's ``rule``, static: (window, chunk, the variant's score rule as splash takes it --
    ``attn_logits_soft_cap``, c tanh(s / c) of the scaled scores before the mask, as ``score_mod``; 0
    none --, the mask builder)."""
    return (window, chunk, float(variant.softcap), mask_of)


def kernel_normaliser(variant):
    """The variant's learned normaliser as splash's ``sinks`` operand: one logit per query head [h],
    float32 (exp(sink) joins the softmax's sum; the kernel's backward returns its gradient), or None."""
    return None if variant.sink is None else variant.sink.astype(jnp.float32)


def forward(rule, q, k, v, segments=None, sink=None):
    """(out [B, h, Tp, E], log-sum-exp [B, h, Tp] float32) of the kernel, no VJP of its own (the --cp
    ring's steps: the ring's custom VJP calls ``backward``); operands typed varying like q."""
    ops = [x for x in (q, k, v, segments, sink) if x is not None]
    return _fwd_p.bind(*ops, rule=rule, has_seg=segments is not None)


def backward(rule, q, k, v, segments, out, lse, dout):
    """(dq, dk, dv) of the kernel's backward from ``out`` and ``lse`` (a ring's final ones: the share of
    this K/V set), no sinks (the ring's ``Variant.cotangent`` has theirs)."""
    ops = [x for x in (q, k, v, segments) if x is not None]
    return _bwd_p.bind(*ops, out, lse, dout, rule=rule, has_seg=segments is not None)


def _bridge_fwd(rule, q, k, v, segments, sink):
    ops = [x for x in (q, k, v, segments, sink) if x is not None]
    out, lse = _fwd_p.bind(*ops, rule=rule, has_seg=segments is not None)
    # the backward's residuals named for --remat save_qkv_attn (``model.memory``): saved, the kernel's
    # forward is not run again in the backward
    out, lse = checkpoint_name(out, ATTN_OUT), checkpoint_name(lse, ATTN_OUT)
    return out, (q, k, v, segments, sink, out, lse)


def _bridge_bwd(rule, res, dout):
    *res, out, lse = res
    ops = [x for x in res if x is not None]
    dq, dk, dv, *dsink = _bwd_p.bind(*ops, out, lse, dout, rule=rule, has_seg=res[3] is not None)
    return dq, dk, dv, None, (dsink[0] if dsink else None)


def bridge(rule, q, k, v, segments, sink):
    """``_one_rule`` through the two primitives (``rule``: window, chunk, soft-cap, mask builder);
    every operand typed as varying like q (the casts' transposes, outside, sum what they must)."""
    return _bridge_fwd(rule, q, k, v, segments, sink)[0]


bridge = jax.custom_vjp(bridge, nondiff_argnums=(0,))
bridge.defvjp(_bridge_fwd, _bridge_bwd)
