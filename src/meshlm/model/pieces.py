"""The model in three pieces, for the pipeline (``sharding.pipelined``); the pieces reuse the model's
own code (``model.transformer``), so a family needs nothing of its own here.
"""

from __future__ import annotations

import haiku as hk
import jax.numpy as jnp

from meshlm.errors import ConfigError
from meshlm.model import masked, mtp, stage_layers
from meshlm.model.attention import doc_starts
from meshlm.model.chunked_xent import HeadRows, head_mean
from meshlm.model.config import ModelConfig
from meshlm.model.layer_kinds import DENSE_STACK
from meshlm.model.lora import freeze
from meshlm.model.memory import layer_gathers, parallel_getter
from meshlm.model.moe import moe_losses
from meshlm.model.stack import dense_prefix, stack_layers
from meshlm.model.transformer import (
    _block,
    _embed,
    _final_norm,
    _head,
    _others,
    _scaled,
    check_inputs,
    mtp_parts,
)
from meshlm.parallel.context import Parallel


# Each is a Haiku function whose parameters are the whole model's of the same names: ``embed``'s the
# embedding, ``layers``' those under ``layers/`` (as many layers as ``cfg.n_layers``: a chunk), ``head``'s
# the final norm and output projection. Chained, they compute ``loss_fn`` (without the mean over dp,
# which the pipeline takes); every family's, from the same code (a tied head's parameters include the
# embedding table: the pipeline passes it to the last stage too and adds the two gradients).
def embed_fn(cfg: ModelConfig, par: Parallel):
    """tokens [B, T] -> hidden [B, T, D] (with ``sp`` [B, T/mp, D] per shard; with cp the tokens are
    this cp shard's chunks first: [B, T/cp, D])."""

    count = stage_layers.prefix(cfg)

    def embed(tokens):
        check_inputs(cfg, par, tokens.shape[-1])  # rotary models go beyond max_seq_len, as local_logits
        with hk.custom_getter(parallel_getter(par)), freeze(cfg):
            x = _scaled(cfg, _embed(cfg, par)(par.seq_local(tokens)))
            if not count:
                return x
            # a MoE's dense prefix runs here, on the first stage (``model.stage_layers``); the rows are
            # whole (cp is refused with a prefix), so their document starts are the whole model's
            starts = None if cfg.doc_mask < 0 else par.tap("doc_starts", doc_starts(tokens, cfg.doc_mask))
            dense = _others(cfg, par)[DENSE_STACK]
            return dense_prefix(cfg, dense, x, _positions(par, x), starts, count, layer_gathers(par))

    return embed


def _positions(par: Parallel, x):
    """[B, T]: the global positions of the tokens of hidden ``x`` on this shard (with ``sp`` x holds
    T/mp of them, with cp its chunks': ``Parallel.positions``)."""
    t = x.shape[1] * (par.layout.mp if par.layout.sp and par.sharded else 1)
    return jnp.broadcast_to(par.positions(t), (x.shape[0], t))


def layers_fn(cfg: ModelConfig, par: Parallel, stats: bool | None = None):
    """hidden [B, T, D] -> hidden: ``cfg.n_layers`` layers at the global positions of the tokens this
    shard holds (``Parallel.positions``: with cp its chunks'). With ``sp`` the hidden is [B, T/mp, D]
    per shard and the positions those of the whole (cp shard's) sequence. With ``cfg.doc_mask`` the
    layers take ``starts`` [B, T] too: where each token's document starts (``attention.doc_starts`` of
    the inputs, computed before the pipeline and passed with each micro-batch). A mixture of experts
    with aux or z losses (or ``stats`` True: the routing metrics) returns (hidden, its layers' routing
    statistics of this shard's tokens [n_layers, 2E + 3]): the pipeline sums them over the step before
    forming the losses."""
    stats = moe_losses(cfg) if stats is None else stats

    def layers(x, starts=None):
        positions = _positions(par, x)
        if cfg.doc_mask >= 0:
            if starts is None:
                raise ConfigError("--doc-mask needs the document starts of each micro-batch; pass starts")
            starts = par.tap("doc_starts", starts)
        with hk.custom_getter(parallel_getter(par)), freeze(cfg):
            out = stack_layers(
                cfg, _block(cfg, par), x, positions, None, starts, _others(cfg, par), layer_gathers(par)
            )
        return (out[0], out[2]) if stats else out[0]

    return layers


def head_loss_fn(cfg: ModelConfig, par: Parallel):
    """(hidden [B, T, D], targets [B, T]) -> the mean loss over this shard's rows (with cp: over this
    shard's chunks of them, ``par.seq_local`` of the whole rows' targets). ``targets`` may be
    {"targets", "weights"}: the SFT loss's step-normalized weights of them (``model.masked``). With
    multi-token prediction on (``model.mtp``) the depths run here, on the last stage, after the final
    layer: ``targets`` is {"targets", "inputs"} (the whole rows: each depth's tokens and labels are
    shifted on them), the loss gains their term, and the value is (loss, the depths' losses [D])."""

    def head_loss(y, targets):
        rows = targets if isinstance(targets, dict) else {"targets": targets}
        weights = par.seq_local(rows[masked.WEIGHTS]) if masked.WEIGHTS in rows else None
        with hk.custom_getter(parallel_getter(par)), freeze(cfg):
            # a tied head reads the table, and the MTP depths embed their tokens by it
            embed = _embed(cfg, par) if cfg.tie_embeddings or cfg.mtp_on else None
            head, normed = _head(cfg, par, embed), _final_norm(cfg, y)
            # the logits, or with --loss-chunk what the chunked loss takes (``model.chunked_xent``)
            out = HeadRows(normed, head.weights()) if cfg.loss_chunk else head(normed)
            depths = _mtp_depths(cfg, par, y, rows, embed, head) if cfg.mtp_on else None
        loss = head_mean(cfg, par, out, par.seq_local(rows["targets"]), weights)
        if depths is None:
            return loss
        per_depth = mtp.depth_losses(cfg, par, rows, depths)
        return loss + mtp.weighted(cfg, par, per_depth).astype(loss.dtype), per_depth

    return head_loss


def _mtp_depths(cfg: ModelConfig, par: Parallel, y, rows, embed, head):
    """The MTP depths' per-shard logits [B, T, V/mp] each, from the last layer's output ``y`` of one
    micro-batch's ``rows`` {"inputs", "targets"} (whole rows: their document starts are the model's)."""
    mtp.check_batch(cfg, rows, masked.WEIGHTS)
    starts = None
    if cfg.doc_mask >= 0:
        starts = par.tap("doc_starts", doc_starts(rows["inputs"], cfg.doc_mask))
    ids = mtp.local_ids(cfg, par, rows)
    parts = mtp_parts(cfg, par, embed, head)
    return mtp.depth_logits(cfg, par, y, ids, **parts, positions=_positions(par, y), starts=starts)[0]
