"""Multi-token prediction (DeepSeek-V3's MTP, Kimi K2's; ``MTPFields``: D = ``mtp_layers`` depths).

Depth d = 1..D at position i joins the previous depth's hidden state h^{d-1}_i (h^0: the main model's
last layer output, before its final norm) with the embedding of the token d ahead, t_{i+d}:
``eh_proj([enorm(Emb(t_{i+d})); hnorm(h^{d-1}_i)])`` (the embedding first: DeepSeek's weights' order,
as vLLM and Megatron-Core join them; the paper writes the other), then one block of the family's main
layer (DeepSeek-V3's MLA + MoE), its own ``head_norm`` (transformers' ``shared_head.norm``) and the
model's shared output head: logits for t_{i+d+1}. The embedding table and the head are the main
model's (one parameter each: their gradients add up).

Loss: depth d's is the mean cross-entropy over the positions that have a target (i < T - d of every
row's T), and the training loss is the main one + ``mtp_weight`` / D x their sum (DeepSeek-V3's
eq. 25, lambda / D).

Sharding: ``eh_proj`` [2D, D] is row-parallel over mp (each shard its slice of the 2D joined inputs,
the partial sums all-reduced as a layer's output, or reduce-scattered under sp); the three norms are
replicated as every norm. The shifted ids and labels need no communication: every cp shard (and mp
shard under sp) holds its rows' whole sequence of ids and takes its own positions' after shifting
(``Parallel.seq_local``), so the tokens across a shard boundary are already there. Under pp the depths
run on the last stage with the head (``pieces.head_loss_fn``), their parameters stored as the head's.
Shapes: global [B, T] ids; hidden states [B, T, D] per shard ([B, T/mp, D] under sp, with cp
[B, T/cp, D]: this shard's chunks).
"""

from __future__ import annotations

import haiku as hk
import jax.numpy as jnp
from jax import lax

from meshlm.errors import ConfigError
from meshlm.model.dense import dense
from meshlm.model.layers import mask_vocab_padding, vocab_parallel_xent
from meshlm.parallel.context import Parallel

MODULE = "mtp_{d}"  # depth d's parameters (d from 0): mtp_0/enorm/scale, mtp_0/eh_proj/w, mtp_0/attn/...
NORMS = ("enorm", "hnorm", "head_norm")


def ahead(seq, n: int):
    """[B, T] -> [B, T]: at position i the entry i + n (zeros past the end: positions without one)."""
    if n == 0:
        return seq
    return jnp.pad(seq[:, n:], ((0, 0), (0, n)))


def depth_ids(inputs, targets, d: int):
    """The tokens depth ``d`` embeds, t_{i+d} at position i ([B, T] global; targets[i] is t_{i+1})."""
    return ahead(targets, d - 1)


def depth_labels(par: Parallel, targets, d: int):
    """This shard's positions' labels of depth ``d``, t_{i+d+1}: shifted on the whole sequence, then
    sliced (with cp the labels near a chunk's end are the next chunk's first tokens)."""
    return par.seq_local(ahead(targets, d))


class EHProj(hk.Module):
    """The row-parallel projection of the joined [embedding; hidden] [B, T, 2D] (sp: [B, T/mp, 2D])
    back to D: w [2D/mp, D] per shard, this shard's rows of the joined features."""

    def __init__(self, *, par: Parallel, stddev: float, name: str = "eh_proj"):
        super().__init__(name=name)
        self.par, self.stddev = par, stddev

    def __call__(self, joined):
        xf = self.par.f(joined)  # [B, T, 2D]: replicated (sp: gathered), entering the row-parallel region
        n = joined.shape[-1] // self.par.layout.mp
        own = lax.dynamic_slice_in_dim(xf, self.par.shard_index() * n, n, axis=-1)
        w = hk.get_parameter("w", [n, joined.shape[-1] // 2], init=hk.initializers.RandomNormal(self.stddev))
        return self.par.row_out(dense(own, w))


class Depth(hk.Module):
    """One MTP module: (h^{d-1} [B, T, D], the embedded tokens d ahead [B, T, D]) -> (h^d, its
    normalized output for the head, the block's routing statistics or None)."""

    def __init__(self, *, par: Parallel, block, norm, stddev: float, name: str):
        super().__init__(name=name)
        self.par, self.block, self.norm, self.stddev = par, block, norm, stddev

    def __call__(self, h, e, positions, starts):
        joined = jnp.concatenate([self.norm("enorm")(e), self.norm("hnorm")(h)], axis=-1)
        x = EHProj(par=self.par, stddev=self.stddev)(joined)
        out = self.block(x, positions, None, starts)
        return out[0], self.norm("head_norm")(out[0]), (out[2] if len(out) == 3 else None)


def depth_logits(cfg, par: Parallel, h, ids, *, embed, head, block, norm, stddev, positions, starts):
    """The D depths' per-shard logits [B, T, V/mp] each (``head``: normalized hidden -> logits) and
    their blocks' routing statistics; ``ids``: each depth's tokens, this shard's positions [B, T]."""
    logits, stats = [], []
    for d in range(cfg.mtp_layers):
        depth = Depth(par=par, block=block(), norm=norm, stddev=stddev, name=MODULE.format(d=d))
        h, y, st = depth(h, embed(ids[d]), positions, starts)
        logits.append(head(y))
        stats.append(st)
    return logits, stats


def local_ids(cfg, par: Parallel, batch) -> list:
    """Each depth's embedded tokens, this shard's positions: [B, T] (with cp [B, T/cp]) per depth."""
    return [
        par.seq_local(depth_ids(batch["inputs"], batch["targets"], d)) for d in range(1, cfg.mtp_layers + 1)
    ]


def depth_losses(cfg, par: Parallel, batch, logits):
    """[D]: each depth's mean cross-entropy over this shard's positions, weighted so that the mean over
    the batch shards (``Parallel.batch_mean``) is the mean over the global batch's positions with a
    target (T - d per row)."""
    targets = batch["targets"]
    t = targets.shape[-1]
    if t <= cfg.mtp_layers:
        raise ConfigError(f"--seq-len {t} leaves depth {cfg.mtp_layers} of MTP no target; use more than that")
    out = []
    for d, local in enumerate(logits, start=1):
        local = mask_vocab_padding(par, par.seq_out(local), cfg.vocab_size)
        per_token = vocab_parallel_xent(par, local, depth_labels(par, targets, d))  # [B, T] (cp: T/cp)
        has_target = par.seq_local(jnp.broadcast_to(jnp.arange(t) < t - d, targets.shape))
        out.append(jnp.mean(jnp.where(has_target, per_token, 0)) * (t / (t - d)))
    return jnp.stack(out)


def weighted(cfg, par: Parallel, per_depth):
    """The depths' term of the training loss: lambda / D x the sum of their losses [D], added once (under
    pp by the last stage's head alone: ``pieces.head_loss_fn``)."""
    return (cfg.mtp_weight / cfg.mtp_layers) * jnp.sum(per_depth)


def check_batch(cfg, batch, weights_key: str) -> None:
    """MTP's loss counts every position with a target: a loss mask (SFT) is refused, not ignored."""
    if weights_key in batch:
        raise ConfigError(
            f"multi-token prediction with a loss mask (SFT) is not built: pass --mtp-weight 0 "
            f"(the model's mtp_weight is {cfg.mtp_weight})"
        )
