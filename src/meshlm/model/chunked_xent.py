"""The head and its cross-entropy, whole or in chunks of tokens (``ModelConfig.loss_chunk``).

Whole (``loss_chunk`` 0), the loss meets the per-shard logits [B, T, V/mp]: in float32 that is
4 B T V / mp bytes, with their gradient as much again (Qwen3's 151,936 ids: 1.2 GiB a 2048-token
row, each). Chunked, the loss takes the normalized hidden rows and the head's weights instead
(``HeadRows``) and runs ``loss_chunk`` tokens at a time, forward and backward, so only one chunk's
logits [c, V/mp] live at a time:

* forward: a ``lax.map`` over the chunks of this shard's B x T tokens (the last one padded with zero
  rows, whose losses are dropped) of the very code of the whole loss -- projection, the logits cap,
  padding mask, ``layers.vocab_parallel_xent`` (pmax and psums over mp) -- keeping per-token losses;
* backward (a custom VJP): a ``lax.scan`` over the chunks that recomputes each chunk's loss under
  ``jax.vjp`` and pulls its cotangent back: the hidden rows' gradient per chunk, the head's weight
  and bias gradients summed in the carry, in at least float32 (a bf16 step's partial sums are not
  rounded chunk by chunk; the whole loss's single matmul is rounded once too).

The cost: each chunk's logits are computed twice (the forward's, then the backward's recomputation),
one matmul of N x D x V/mp more than the whole loss's three. The collectives inside are JAX's own (their
transposes come from ``jax.vjp``), so ``shard_map(check_vma=True)`` types them; the weights are made
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
import numpy as np
from jax import lax

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


def head_xent(cfg, par: Parallel, out, targets):
    """Per-token loss [B, T] (with cp [B, T/cp]; replicated over mp) of the model's output ``out``:
    per-shard logits [B, T, V/mp], or with ``cfg.loss_chunk`` its ``HeadRows``; targets [B, T]."""
    if isinstance(out, HeadRows):
        return chunked_xent(cfg, par, out, targets)
    logits = mask_vocab_padding(par, par.seq_out(out), cfg.vocab_size)  # padded ids never chosen
    return vocab_parallel_xent(par, logits, targets, cfg.z_loss)


def chunked_xent(cfg, par: Parallel, rows: HeadRows, targets):
    """``head_xent`` of the logits ``rows`` make, ``cfg.loss_chunk`` tokens at a time (the module
    docstring says how); the same values, up to summation order."""
    xf = par.seq_out(par.f(rows.x))  # [B, T, D] per shard: entering the vocabulary-parallel region once
    bsz, t, d = xf.shape
    n, c = bsz * t, cfg.loss_chunk
    k = -(-n // c)  # chunks; the last one padded to c tokens
    chunks = _padded(xf.reshape(n, d), k * c).reshape(k, c, d)
    ids = _padded(targets.reshape(n), k * c).reshape(k, c)
    # every axis the rows vary over (dp, cp, mp): the weight gradients' sums over them are the casts'
    # transposes, once, after the loop
    w, b = varying_like(rows.weights, chunks, ids)
    per_token = _chunked(partial(_chunk_losses, cfg, par))(w, b, chunks, ids)  # [k, c]
    return per_token.reshape(k * c)[:n].reshape(bsz, t)


def _padded(x, size: int):
    """x [N, ...] -> [size, ...], zeros after its rows (a padded chunk's rows: finite, dropped)."""
    return jnp.pad(x, [(0, size - x.shape[0])] + [(0, 0)] * (x.ndim - 1))


def _chunk_losses(cfg, par: Parallel, w, b, xf, ids):
    """One chunk: xf [c, D] per shard, ids [c] -> per-token loss [c], as ``head_xent`` computes it."""
    logits = mask_vocab_padding(par, capped_logits(cfg, project(xf, w, b)), cfg.vocab_size)  # [c, V/mp]
    return vocab_parallel_xent(par, logits, ids, cfg.z_loss)


def _chunked(losses):
    """``losses(w, b, xf [c, D], ids [c]) -> [c]`` over chunks [k, c, ...], as a function with the
    custom VJP of the module docstring: (w, b, xf [k, c, D], ids [k, c]) -> [k, c]."""

    @jax.custom_vjp
    def run(w, b, xf, ids):
        return lax.map(lambda chunk: losses(w, b, *chunk), (xf, ids))

    def forward(w, b, xf, ids):
        return run(w, b, xf, ids), (w, b, xf, ids)

    def backward(saved, g):  # g [k, c]: the per-token losses' cotangent
        w, b, xf, ids = saved

        def step(acc, chunk):
            x, i, gc = chunk
            _, pull = jax.vjp(lambda w, b, x: losses(w, b, x, i), w, b, x)
            dw, db, dx = pull(gc)
            return _accumulate(acc, (dw, db)), dx

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, upcast(p).dtype), (w, b))
        (dw, db), dx = lax.scan(step, varying_like(zeros, w, b), (xf, ids, g))
        cast = lambda d, p: d.astype(p.dtype)
        return cast(dw, w), jax.tree.map(cast, db, b), dx, np.zeros(ids.shape, jax.dtypes.float0)

    run.defvjp(forward, backward)
    return run


def _accumulate(acc, grads):
    """The weight gradients' running sum over the chunks (in ``acc``'s dtype: at least float32)."""
    return jax.tree.map(lambda a, d: a + d.astype(a.dtype), acc, grads)
