"""``meshlm verify --objective sft``: the chat SFT loss, Σ(mask · token loss) / Σ(mask) over the whole
global batch (``model.masked``), proven equal to the unsharded run under every mesh.

The problem is the model's own (``model_problem``) with a loss mask on its targets, as a chat store's
batches carry: each row one or two assistant spans of its own length, so that the mask counts differ
between rows, data shards, pipeline micro-batches and cp chunks (a division by any one part's count is
then a different number). Both runs take the mask normalized over the step (``masked.loss_weights``);
the training steps' batches carry the mask itself, normalized by the train step (``optim.make_step``)
and, independently, by the reference step (``proof.reference``).

Controls (each changes the sharded run only):
* the mask applied after the mean: mean(loss) · mean(weights), every target trained on;
* the loss divided per micro-batch: each shard's (pipeline micro-batch's, cp chunk's) weighted sum
  divided by its own mask count -- the mean of per-part means, which differs wherever counts differ
  (applies where the batch is split into parts: dp, ep, cp or a pipeline's micro-batches).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from meshlm.model import masked
from meshlm.proof.control_record import Control, Where


def sft_mask(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """uint8 ``shape`` [..., T]: per row one or two spans of 1, every row's count its own (distinct
    while there are fewer rows than positions), never all ones, never all zeros. The last span ends the
    row (a packed row's last answer runs to its end): a fault that moves only the latest positions
    (a kernel's last block) still reaches the loss."""
    rng = np.random.default_rng([seed, 0x5F7])
    rows, t = int(np.prod(shape[:-1])), shape[-1]
    counts = rng.permutation(np.arange(1, t))[:rows] if rows < t else rng.integers(1, t, rows)
    mask = np.zeros((rows, t), np.uint8)
    for row, count in zip(mask, counts, strict=True):
        first = int(rng.integers(1, count + 1)) if count > 1 and rng.random() < 0.5 else int(count)
        second = int(count) - first
        row[t - first :] = 1  # the last turn, to the row's end
        if second:  # an earlier turn where the count was split, before a gap of at least one
            start = int(rng.integers(0, t - first - second))
            row[start : start + second] = 1
    return mask.reshape(shape)


def sft_problem(problem):
    """``problem`` (a ``model_problem``) with a loss mask on its batch and its training steps' batches."""
    base = problem.batch_fn
    if base is None:
        from functools import partial

        from meshlm.proof.problem import random_batch

        base = partial(random_batch, problem.cfg.vocab_size)

    def batch_fn(shape, seed):
        return {**base(shape, seed), masked.LOSS_MASK: sft_mask(shape, seed)}

    batch = {**problem.batch, masked.LOSS_MASK: sft_mask(problem.batch["inputs"].shape, 1)}
    return dataclasses.replace(problem, batch=batch, batch_fn=batch_fn, name=f"{problem.name} (SFT mask)")


def proof_batch(batch: dict, cfg=None) -> dict:
    """The host batch both runs' loss and gradients take: the mask normalized over it (``loss_weights``);
    with ``cfg``'s LoRA dropout, each token's dropout seed as the train step's first step gives it."""
    batch = masked.loss_weights(batch)
    if cfg is not None and cfg.lora_dropout:
        from meshlm.model.lora_dropout import with_seeds

        batch = with_seeds(batch, 0, 0)
    return {k: np.asarray(v) for k, v in batch.items()}


@contextlib.contextmanager
def _token_mean(fn):
    """Plant ``fn`` as ``masked.token_mean`` while the sharded run traces."""
    saved = masked.token_mean
    masked.token_mean = fn
    try:
        yield
    finally:
        masked.token_mean = saved


def _mask_after_mean(per_token, weights=None):
    out = jnp.mean(per_token)
    return out if weights is None else out * jnp.mean(weights).astype(out.dtype)


def _divided_per_part(per_token, weights=None):
    if weights is None:
        return jnp.mean(per_token)
    w = weights.astype(per_token.dtype)
    return jnp.sum(per_token * w) / jnp.maximum(jnp.sum(w), 1e-30)  # this part's own count (scaled)


def _parts(where: Where) -> int:
    """Into how many parts the sharded run cuts the batch, each with its own mean."""
    layout = where.layout
    return math.prod(layout.shape[a] for a in layout.batch_axes) * layout.pipeline_microbatches


SFT_CONTROLS = (
    Control(
        name="SFT mask applied after the mean",
        applies=lambda w: w.cfg is not None,
        plant=lambda: _token_mean(_mask_after_mean),
    ),
    Control(
        name="SFT loss divided per micro-batch (per shard)",
        applies=lambda w: w.cfg is not None and _parts(w) > 1,
        plant=lambda: _token_mean(_divided_per_part),
    ),
)
