"""The SFT loss: Σ(mask · token loss) / Σ(mask) over the whole global step batch, as per-token weights.

A step's batch may carry ``"loss_mask"`` (0/1 per target: global [B, T], or [A, B, T] with gradient
accumulation). ``loss_weights`` turns it, once per step and on the global arrays (under ``jit`` XLA sums
over every shard), into ``"weights"`` = mask · N / Σ mask, N the number of targets in the step batch.
Every mean the sharded programs already take -- per shard, over dp and cp (``Parallel.batch_mean``),
per pipeline micro-batch, over accumulation micro-batches -- is over equal token counts, so each
computes mean(weights · loss) of the whole step: exactly Σ(mask · loss) / Σ mask, under every mesh.
Dividing by each micro-batch's or shard's own count instead (``token_mean`` with ``per_part``) is a
different objective wherever counts differ; the proof plants it (``proof.sft``).
"""

from __future__ import annotations

import jax.numpy as jnp

LOSS_MASK = "loss_mask"  # the batch entry: 0/1 per target
WEIGHTS = "weights"  # what ``loss_weights`` makes of it: the per-token weights of the step's mean


def loss_weights(batch: dict) -> dict:
    """``batch`` with its ``loss_mask`` replaced by ``weights`` normalized over all of it (every
    micro-batch of the step): mean(weights) == 1. A batch without a mask is returned as it is; a
    step whose mask is all zero gets zero weights (a zero loss), not NaN."""
    if LOSS_MASK not in batch:
        return batch
    dtype = jnp.asarray(1.0).dtype  # float64 where enabled (verify in float64), else float32
    mask = jnp.asarray(batch[LOSS_MASK]).astype(dtype)
    weights = mask * (mask.size / jnp.maximum(jnp.sum(mask), 1))
    return {**{k: v for k, v in batch.items() if k != LOSS_MASK}, WEIGHTS: weights}


def token_mean(per_token, weights=None):
    """The mean over this shard's (micro-batch's) targets of the per-token loss [B, T], weighted by the
    step-normalized ``weights`` [B, T] (None: every target counts one)."""
    if weights is None:
        return jnp.mean(per_token)
    return jnp.mean(per_token * weights.astype(per_token.dtype))
