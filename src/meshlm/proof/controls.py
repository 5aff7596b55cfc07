"""Negative controls: planted faults the proof must detect (a control that passes is a failure).

Each control changes exactly one thing in the *sharded* run: a ``Parallel`` subclass overriding one
method, a config change, or a training-step fault. Layers are unchanged. A control only runs where
its fault can change the result (e.g. collective faults need mp > 1).

Most faults change values and are detected by the comparison with the reference. One is invisible
to values by construction (a redundant all-reduce) and is detected by the communication check,
which compares the compiled step's collectives with the Megatron minimum.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from meshlm.model.params import param_path
from meshlm.parallel.axes import DP, MP
from meshlm.parallel.context import Parallel
from meshlm.proof.control_record import Control, Where
from meshlm.proof.documents import DocMaskCrossesOnOneShard, DocMaskIgnoresBoundary, doc_mask_off
from meshlm.proof.family_faults import (
    GEMMA_CONTROLS,
    HeadBiasOfNextShard,
    TiedHeadGradDropped,
    TiedHeadOtherSlice,
    embedding_scaled_twice,
    proj_norm_local_statistic,
    qk_norm_after_rotary,
    qk_norm_grad_not_summed,
    window_off_by_one,
)
from meshlm.proof.flash_controls import FLASH_CONTROLS
from meshlm.proof.linear_controls import LINEAR_CONTROLS
from meshlm.proof.loss_controls import LOSS_CONTROLS
from meshlm.proof.mla_faults import MLA_CONTROLS
from meshlm.proof.moe_controls import MOE_CONTROLS
from meshlm.proof.mtp_faults import MTP_CONTROLS
from meshlm.proof.per_layer_controls import PER_LAYER_CONTROLS
from meshlm.proof.pipeline_verify import engine_sums_over_dp
from meshlm.proof.router_controls import ROUTER_CONTROLS
from meshlm.proof.taps import Tapped


class DroppedAllReduce(Parallel):
    """The row-parallel all-reduce keeps one shard's partial sum, dropping the others."""

    def row_out(self, partial, bias=None):
        mine = jnp.where(self.shard_index() == 0, partial, jnp.zeros_like(partial))
        out = self.row_sum(mine)
        return out if bias is None else out + bias


class BiasCountedMpTimes(Parallel):
    """The prototype's bug: every shard adds the row-parallel bias before the all-reduce."""

    def row_out(self, partial, bias=None):
        return self.row_sum(partial if bias is None else partial + bias)


class WrongVocabSlice(Parallel):
    """Each shard reads the vocabulary slice of its neighbour."""

    def vocab_start(self, vocab_per_shard: int):
        return ((self.shard_index() + 1) % self.layout.mp) * vocab_per_shard


class MissingDpMean(Parallel):
    """The loss is summed over data-parallel shards instead of averaged."""

    def batch_mean(self, x):
        return lax.psum(x, DP)


class OtherShardsHeads(Tapped):
    """Each shard computes its queries with the next shard's query-head weights. An all-gather over mp,
    not a permute: under pp an MTP depth's attention runs with the head on the last stage only (a branch
    of a ``cond``), and XLA:CPU runs a permute over mp as one collective of every device, which the
    other stages never join (a deadlock; ``family_faults.TiedHeadOtherSlice`` alike)."""

    def own_heads(self, w):
        every = lax.all_gather(w, MP, axis=0, tiled=False)  # [mp, *w.shape]
        return every[(self.shard_index() + 1) % self.layout.mp]


class KvNotReplicated(Parallel):
    """With mp > K, a shard takes KV head (shard % K) instead of the one its query group needs."""

    def kv_head_index(self, n_heads: int, n_kv_heads: int):
        return self.shard_index() % n_kv_heads


class ExtraAllReduce(Parallel):
    """A redundant second all-reduce after every row-parallel one: same values (the sum of mp copies
    divided by mp; exact for power-of-two mp), twice the communication in forward and backward. With
    sequence parallelism the redundant pair is an all-gather and a reduce-scatter of the slices."""

    def row_sum(self, partial):
        out = super().row_sum(partial)
        if not self.sharded:
            return out
        if self.layout.sp:
            return (
                lax.psum_scatter(self.gather_seq(out), MP, scatter_dimension=1, tiled=True) / self.layout.mp
            )
        return lax.psum(lax.pcast(out, MP, to="varying") / self.layout.mp, MP)


class FsdpGradFromOneShard(Parallel):
    """FSDP: each data shard keeps its own gradient of its weight slice instead of the reduce-scatter
    (the sum over data shards): the gathered weight's gradient reaches only the local slice."""

    def gather_weight(self, w, dim: int, axes=DP):
        full = lax.stop_gradient(super().gather_weight(w, dim, axes))
        own = w - lax.stop_gradient(w)  # zero, with the identity as gradient
        start = lax.axis_index(axes) * w.shape[dim]
        return full + lax.dynamic_update_slice_in_dim(jnp.zeros_like(full), own, start, dim)


class FsdpGatherWrongOrder(Parallel):
    """FSDP: the all-gather concatenates the data shards' slices rotated by one."""

    def gather_weight(self, w, dim: int, axes=DP):
        parts = jnp.roll(lax.all_gather(w, axes, axis=0, tiled=False), 1, axis=0)  # [shards, ...]
        return jnp.concatenate(list(parts), axis=dim)  # the data shards it is split over


class SpNormGradNotSummed(Tapped):
    """SP: a norm parameter's gradient is one shard's (its own sequence slice), not the sum over mp."""

    def norm_param(self, p):
        keep = self.shard_index() == 0
        return lax.stop_gradient(p) + jnp.where(keep, p - lax.stop_gradient(p), jnp.zeros_like(p))


class SpSeqWrongOrder(Parallel):
    """SP: the sequence all-gather concatenates the shards' slices rotated by one."""

    def gather_seq(self, x):
        parts = jnp.roll(lax.all_gather(x, MP, axis=0, tiled=False), 1, axis=0)  # [mp, B, T/mp, ...]
        return jnp.concatenate([parts[i] for i in range(self.layout.mp)], axis=1)


def per_shard_clip(mesh, specs, max_norm: float):
    """Clipping by the norm of one shard's local gradient slices instead of the full gradient."""
    from jax.sharding import PartitionSpec as P

    def local(grads):
        sq = sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads))
        sq = lax.psum(jnp.where(lax.axis_index(MP) == 0, sq, 0.0), MP)  # shard 0's view
        norm = jnp.sqrt(sq)
        return jnp.where(norm < max_norm, 1.0, max_norm / norm).astype(norm.dtype), norm  # (scale, norm)

    return jax.shard_map(local, mesh=mesh, in_specs=(specs,), out_specs=(P(), P()))


def _swap_rotary(cfg):
    return cfg.replace(rotary_style="half" if cfg.rotary_kind == "interleaved" else "interleaved")


CONTROLS: tuple[Control, ...] = (
    Control(name="dropped all-reduce", applies=lambda w: w.layout.mp > 1, par_cls=DroppedAllReduce),
    Control(
        name="row-parallel bias counted mp times",
        applies=lambda w: w.layout.mp > 1 and w.has_row_bias,
        par_cls=BiasCountedMpTimes,
    ),
    Control(name="shard reads wrong vocab slice", applies=lambda w: w.layout.mp > 1, par_cls=WrongVocabSlice),
    Control(
        name="missing data-parallel mean",
        applies=lambda w: w.layout.dp > 1 and not w.layout.pipelined,
        par_cls=MissingDpMean,
    ),
    Control(  # under pp the engine takes the mean over dp (``pipeline_verify.EngineSumsOverDp``)
        name="missing data-parallel mean",
        applies=lambda w: w.layout.dp > 1 and w.layout.pipelined,
        pipe_cls=engine_sums_over_dp,
    ),
    Control(
        name="shard uses another shard's heads",
        applies=lambda w: w.layout.mp > 1 and w.attention,
        par_cls=OtherShardsHeads,
    ),
    Control(name="wrong rotary convention", applies=lambda w: w.attention, cfg_change=_swap_rotary),
    Control(
        name="KV heads not replicated per query group",
        applies=lambda w: w.kv_replicated,
        par_cls=KvNotReplicated,
    ),
    Control(name="per-shard gradient-norm clipping", applies=lambda w: w.layout.mp > 1, per_shard_clip=True),
    Control(
        name="extra all-reduce after each row-parallel one",
        applies=lambda w: w.layout.mp > 1 and w.collectives and w.cfg is not None,
        par_cls=ExtraAllReduce,
        by_collectives=True,
    ),
    Control(
        name="FSDP gradient kept from one data shard",
        applies=lambda w: w.layout.fsdp and w.layout.dp > 1,
        par_cls=FsdpGradFromOneShard,
    ),
    Control(
        name="FSDP all-gather in the wrong order",
        applies=lambda w: w.layout.fsdp and w.layout.dp > 1,
        par_cls=FsdpGatherWrongOrder,
    ),
    Control(
        name="SP norm gradients not summed over mp",
        applies=lambda w: w.layout.sp and w.layout.mp > 1 and w.attention,
        par_cls=SpNormGradNotSummed,
    ),
    Control(
        name="SP sequence shards gathered in the wrong order",
        applies=lambda w: w.layout.sp and w.layout.mp > 1,
        par_cls=SpSeqWrongOrder,
    ),
)


def _qkv_bias(w: Where) -> bool:
    return w.attention and w.cfg.arch.qkv_bias


def _tied(w: Where) -> bool:
    return w.cfg is not None and w.cfg.tie_embeddings


CONTROLS += (
    Control(
        name="q/k/v bias not sliced with its heads",
        applies=lambda w: w.layout.mp > 1 and _qkv_bias(w),
        par_cls=HeadBiasOfNextShard,
    ),
    Control(
        name="tied head reads another shard's vocab slice",
        applies=lambda w: w.layout.mp > 1 and _tied(w),
        par_cls=TiedHeadOtherSlice,
    ),
    Control(
        name="tied head's gradient not added to the embedding", applies=_tied, par_cls=TiedHeadGradDropped
    ),
)


class PaddingNotMasked(Parallel):
    """The vocabulary padding's logits stay in the softmax: every column is taken for a real id."""

    def real_vocab_columns(self, vocab_per_shard: int, vocab_size: int):
        return jnp.ones((vocab_per_shard,), bool)


PADDED_LOGIT_SCALE = 1e3


def large_padded_logits(cfg, params):
    """The output projection's padded columns set to +-``PADDED_LOGIT_SCALE`` times real columns
    (in pairs, + and -, so one of each pair has a logit >= 1000 |real logit| for every token).

    Padded columns start at zero, and zero logits hide: 47 of them beside GPT-2's 50257 move the loss
    by log(50304/50257) ~ 1e-4 relative, inside float32's tolerance. A masked model ignores whatever
    the padded columns hold (the proof's own values show it); an unmasked one is now far off."""
    from meshlm.model.padding import VOCAB_AXIS
    from meshlm.parallel.placement import put_global, to_host

    head = ("embed/embeddings",) if cfg.tie_embeddings else ("head/w", "head/b")

    def plant(path, x):
        if path not in head:
            return x
        axis, real = VOCAB_AXIS[path], cfg.vocab_size
        host = np.moveaxis(np.array(to_host(x)), axis, 0)  # [V_padded, ...]
        n_pad = host.shape[0] - real
        sources = np.linspace(0, real - 1, (n_pad + 1) // 2).astype(int).repeat(2)[:n_pad]
        signs = np.where(np.arange(n_pad) % 2, -1.0, 1.0).reshape([-1] + [1] * (host.ndim - 1))
        host[real:] = PADDED_LOGIT_SCALE * signs * host[sources]
        return put_global(np.moveaxis(host, 0, axis), x.sharding)

    return {m: {n: plant(param_path(m, n), x) for n, x in leaves.items()} for m, leaves in params.items()}


CONTROLS += (
    Control(
        name="padded logits not masked",
        applies=lambda w: w.cfg is not None and w.cfg.padded_vocab != w.cfg.vocab_size,
        par_cls=PaddingNotMasked,
        params_change=large_padded_logits,
    ),
)


def _doc_masked(w: Where) -> bool:
    return w.cfg is not None and w.cfg.doc_mask >= 0


CONTROLS += (  # --doc-mask (``proof.documents``): the batches are EOD-rich there
    Control(name="document mask ignores one boundary", applies=_doc_masked, par_cls=DocMaskIgnoresBoundary),
    Control(
        name="document mask crosses a boundary on one shard",
        applies=lambda w: _doc_masked(w) and w.layout.mp > 1,
        par_cls=DocMaskCrossesOnOneShard,
    ),
    Control(name="document mask off (the mask must matter)", applies=_doc_masked, cfg_change=doc_mask_off),
)


CONTROLS += (
    # Detectable only where some query has a key exactly ``window`` positions back: window < seq_len.
    Control(
        name="sliding window off by one",
        applies=lambda w: w.attention and 0 < w.cfg.sliding_window < w.seq_len,
        cfg_change=window_off_by_one,
    ),
    Control(
        name="embedding scale applied twice",
        applies=lambda w: w.cfg is not None and w.cfg.arch.embed_scale,
        params_change=embedding_scaled_twice,
    ),
)


def _head_qk_norm(w: Where) -> bool:
    return w.attention and w.cfg.arch.qk_norm in ("head", "head_plus_one")


CONTROLS += (  # the q/k norms of Qwen3 (per head) and OLMo 2 (``proof.family_faults``)
    Control(name="q/k norm applied after rotary", applies=_head_qk_norm, plant=qk_norm_after_rotary),
    Control(
        name="q/k norm gradient not summed over mp",
        applies=lambda w: w.layout.mp > 1 and _head_qk_norm(w),
        plant=qk_norm_grad_not_summed,
    ),
    Control(  # OLMo 2's norm over the whole projection: its heads split over mp
        name="OLMo 2's norm statistics from the local shard only",
        applies=lambda w: w.layout.mp > 1 and w.attention and w.cfg.arch.qk_norm == "proj",
        plant=proj_norm_local_statistic,
    ),
)

CONTROLS += FLASH_CONTROLS  # the flash kernel's mask, segments and window (``proof.flash_controls``)
CONTROLS += GEMMA_CONTROLS  # Gemma 2's score and logit caps (off, out of order), Gemma 2/3's layer kinds

CONTROLS += MOE_CONTROLS + ROUTER_CONTROLS + LINEAR_CONTROLS  # ``proof.moe_controls``, router, linear
CONTROLS += MLA_CONTROLS  # multi-head latent attention's and YaRN's (``proof.mla_faults``)
CONTROLS += MTP_CONTROLS  # multi-token prediction's shifted tokens and labels (``proof.mtp_faults``)
CONTROLS += PER_LAYER_CONTROLS  # Gemma 4's keys as values, shared KV, per-layer inputs
CONTROLS += LOSS_CONTROLS  # the chunked cross-entropy's (``--loss-chunk``: ``proof.loss_controls``)

__all__ = ["CONTROLS", "Control", "Where", "per_shard_clip"]
