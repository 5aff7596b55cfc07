"""The head and its cross-entropy, whole or in chunks of tokens (``ModelConfig.loss_chunk``).

Whole (``loss_chunk`` 0), the loss meets the per-shard logits [B, T, V/mp]: in float32 that is
4 B T V / mp bytes, with their gradient as much again (Qwen3's 151,936 ids: 1.2 GiB a 2048-token
row, each). Chunked, the loss takes the normalized hidden rows and the head's weights instead
(``HeadRows``) and runs ``loss_chunk`` tokens at a time, so only one chunk's logits [c, V/mp] live at
a time, and it computes the head's gradients in its forward (as Liger's fused linear cross-entropy):

* primal (evaluation, nothing differentiated): a ``lax.map`` over the chunks of this shard's B x T
  tokens (the last one padded with zero rows of weight 0) of the very code of the whole loss --
  projection, the logits cap, padding mask, ``layers.vocab_parallel_xent`` (pmax and psums over mp)
  -- and the weighted sum of the per-token losses: one head matmul;
* differentiated (a custom VJP): the forward is a ``lax.scan`` that runs each chunk's loss under
  ``jax.vjp`` and pulls the chunk's token weights back at once -- dlogits (softmax - onehot, through
  the cap, the mask and z-loss as JAX differentiates them), the hidden rows' gradient dlogits @ W^T,
  the head's weight and bias gradients X^T @ dlogits summed in the carry in at least float32 (a bf16
  step's partial sums are not rounded chunk by chunk); the backward only scales what the forward
  stored by the incoming cotangent (the mean's 1 / N, the data-parallel mean's, a pipeline's 1 / M).

The value is the *sum* of the weighted per-token losses (each token's weight ``masked.token_mean``'s
own coefficient times N: 1, or the SFT loss's weight); ``chunked_mean`` divides it by the N tokens
outside the custom VJP, so its cotangent carries 1 / N and a backward that ignores it cannot pass the
proof. (In a bf16 step the rows' gradient is scaled after its bf16 matmul: exact where the cotangent
is a power of two, as 1 / N is for rows and batches of powers of two; else one more bf16 rounding.)
Three head matmuls when trained (the whole loss's count; the recomputing backward this replaced
did four), one in evaluation. What it keeps from forward to backward: the hidden rows' gradient
(x's size, in x's dtype; x itself is not kept) and the head's gradients in float32 [D, V/mp] (the sum
the recomputing backward held in its loop). A frozen head (LoRA: ``lax.stop_gradient``, not
perturbed, ``symbolic_zeros``) gets no weight gradient matmul. The collectives inside are JAX's own
(the transposes of psum under ``shard_map(check_vma=True)`` communicate nothing); the weights are made
varying over every axis the rows vary over before the loop, so their gradient's sum over dp is one
collective after it (that cast's transpose), not one per chunk. ``meshlm verify --x64 --loss-chunk N``
proves the chunked sharded step equal to the whole loss, unsharded (the reference runs loss_chunk 0).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import custom_vjp_primal_tree_values

from meshlm.model import masked
from meshlm.model.attention_variants import capped_logits
from meshlm.model.layers import mask_vocab_padding, project, upcast, varying_like, vocab_parallel_xent
from meshlm.parallel.context import Parallel


class Head:
    """The output projection: normalized x [B, T, D] -> per-shard logits [B, T, V/mp], ``capped_logits``.
    ``weights`` reads (w [D, V/mp], b [V/mp] or None) as this shard uses them (one module or the tied
    embedding's table, so that every use shares them; FSDP-gathered by the model's getter)."""

    def __init__(self, cfg, par: Parallel, weights: Callable):
        self.cfg, self.par, self.weights = cfg, par, weights

    def __call__(self, x):
        return capped_logits(self.cfg, project(self.par.f(x), *self.weights()))


class HeadRows(NamedTuple):
    """What the chunked loss takes in the logits' place: the final-normed hidden x [B, T, D] (with sp
    [B, T/mp, D] per shard) and the head's (w, b) (``Head.weights``)."""

    x: jax.Array
    weights: tuple


def head_mean(cfg, par: Parallel, out, targets, weights=None):
    """This shard's mean loss (``masked.token_mean``, with the SFT loss's ``weights`` [B, T] or None) of
    the model's output ``out``: per-shard logits [B, T, V/mp], or with ``cfg.loss_chunk`` its
    ``HeadRows``; targets [B, T] (with cp [B, T/cp])."""
    if isinstance(out, HeadRows):
        return chunked_mean(cfg, par, out, targets, weights)
    return masked.token_mean(head_xent(cfg, par, out, targets), weights)


def head_xent(cfg, par: Parallel, logits, targets):
    """Per-token loss [B, T] (with cp [B, T/cp]; replicated over mp) of per-shard logits [B, T, V/mp]."""
    logits = mask_vocab_padding(par, par.seq_out(logits), cfg.vocab_size)  # padded ids never chosen
    return vocab_parallel_xent(par, logits, targets, cfg.z_loss)


def chunked_mean(cfg, par: Parallel, rows: HeadRows, targets, weights=None):
    """``head_mean`` of the logits ``rows`` make, ``cfg.loss_chunk`` tokens at a time (the module
    docstring says how); the same value, up to summation order."""
    xf = par.seq_out(par.f(rows.x))  # [B, T, D] per shard: entering the vocabulary-parallel region once
    bsz, t, d = xf.shape
    n = bsz * t
    dtype = jnp.promote_types(xf.dtype, jnp.float32)  # the per-token losses' (``upcast``)
    # each token's weight in the mean: ``masked.token_mean``'s own coefficients (it is linear in the
    # losses; the SFT loss's weights / n), times n: the custom VJP sums, the division by n is outside it.
    # Its argument varies as the targets: an invariant one's gradient would be summed over the shards.
    mean = jax.grad(lambda per_token: masked.token_mean(per_token, weights))
    share = (mean(varying_like(jnp.zeros((bsz, t), dtype), targets)) * n).reshape(n)
    ids = targets.reshape(n)
    # every axis the rows vary over (dp, cp, mp): the weight gradients' sums over them are the casts'
    # transposes, once, after the loop; the token weights vary as the targets (a constant 1 does not)
    w, b = varying_like(rows.weights, xf, ids)
    fused = _fused(
        partial(_chunk_losses, cfg, par), cfg.loss_chunk, (w.dtype, None if b is None else b.dtype)
    )
    # the sum over this shard's tokens, divided outside the custom VJP: its cotangent carries the 1 / n
    return fused(w, b, xf.reshape(n, d), ids, varying_like(share, ids)) / n


def _chunk_losses(cfg, par: Parallel, w, b, x, ids):
    """One chunk: x [c, D] per shard, ids [c] -> per-token loss [c], as ``head_xent`` computes it."""
    logits = mask_vocab_padding(par, capped_logits(cfg, project(x, w, b)), cfg.vocab_size)  # [c, V/mp]
    return vocab_parallel_xent(par, logits, ids, cfg.z_loss)


def _in_chunks(tree, c: int):
    """Each leaf [N, ...] -> [k, c, ...], k = ceil(N / c): zero rows after the last (a padded chunk's
    rows: finite, of weight 0)."""

    def split(a):
        k = -(-a.shape[0] // c)
        padded = jnp.pad(a, [(0, k * c - a.shape[0])] + [(0, 0)] * (a.ndim - 1))
        return padded.reshape(k, c, *a.shape[1:])

    return jax.tree.map(split, tree)


def _unchunked(a, n: int):
    """[k, c, ...] -> the first n rows [n, ...]: the chunks' rows back in order, the padding dropped."""
    return a.reshape(-1, *a.shape[2:])[:n]


def _fused(losses, c: int, dtypes: tuple):
    """``losses(w, b, x [c, D], ids [c]) -> [c]`` over chunks of c tokens, as a function with the
    custom VJP of the module docstring: (w, b, x [N, D], ids [N], share [N]) -> Σ share · loss, a
    scalar. ``dtypes``: of (w, b) (b None: no bias), what their gradients are cast to."""

    @jax.custom_vjp
    def run(w, b, x, ids, share):
        per_token = lax.map(lambda chunk: losses(w, b, *chunk), _in_chunks((x, ids), c))
        return jnp.sum(_unchunked(per_token, ids.shape[0]) * share)

    def forward(*primals):  # each leaf a CustomVJPPrimal (``symbolic_zeros``): .value, .perturbed
        w, b, x, ids, share = custom_vjp_primal_tree_values(primals)
        wrt = tuple(k for k, p in zip("wbx", primals[:3], strict=True) if p is not None and p.perturbed)
        acc, per_token, dx = _forward_grads(losses, c, dict(w=w, b=b, x=x), wrt, (ids, share))
        keep = per_token if primals[4].perturbed else None  # the token weights' gradient (they are data)
        return jnp.sum(per_token * share), (acc, dx, keep)

    def backward(saved, g):  # g: the summed loss's cotangent (a scalar)
        acc, dx, per_token = saved
        dw, db = (
            None if acc.get(k) is None else _scaled(g, acc[k], dt) for k, dt in zip("wb", dtypes, strict=True)
        )
        ds = None if per_token is None else _scaled(g, per_token, per_token.dtype)
        dx = None if dx is None else _scaled(g, dx, dx.dtype)
        return dw, db, dx, None, ds

    run.defvjp(forward, backward, symbolic_zeros=True)
    return run


def _forward_grads(losses, c: int, args: dict, wrt: tuple, data: tuple):
    """The chunks' per-token losses [N] and their weighted sum's gradients w.r.t. the ``wrt`` of
    ``args`` (w, b, x), computed chunk by chunk: ({w, b: float32 sums}, per-token [N], dx [N, D] or None).
    ``data``: ids [N] and the token weights [N]."""
    n = data[0].shape[0]
    sums = {k: args[k] for k in wrt if k != "x"}  # the head's: summed over the chunks
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, upcast(p).dtype), sums)

    def step(acc, chunk):
        x, ids, share = chunk
        per_token, pull = jax.vjp(lambda d: losses(**{**args, "x": x, **d}, ids=ids), _wrt(args, wrt, x))
        (grads,) = pull(varying_like(share.astype(per_token.dtype), per_token))  # typed as its losses
        return _accumulate(acc, {k: grads[k] for k in acc}), (per_token, grads.get("x"))

    acc, (per_token, dx) = lax.scan(
        step, varying_like(zeros, *sums.values()), _in_chunks((args["x"], *data), c)
    )
    return acc, _unchunked(per_token, n), None if dx is None else _unchunked(dx, n)


def _wrt(args: dict, wrt: tuple, x):
    """What one chunk differentiates: ``args``' ``wrt`` entries, x this chunk's rows."""
    return {k: (x if k == "x" else args[k]) for k in wrt}


def _accumulate(acc, grads):
    """The weight gradients' running sum over the chunks (in ``acc``'s dtype: at least float32)."""
    return jax.tree.map(lambda a, d: a + d.astype(a.dtype), acc, grads)


def _scaled(g, grad, dtype):
    """A gradient the forward stored, times the cotangent ``g`` (in at least float32), as ``dtype``."""
    return (upcast(grad) * g.astype(upcast(grad).dtype)).astype(dtype)
