"""Planted faults of blockwise attention and context parallelism (``verify --attention blockwise``,
``verify --cp N``): each must be detected by the comparison with the plain, unsharded reference.

Context parallelism (``Parallel`` subclasses overriding one method each, as ``proof.controls``):
  rotary positions restart in every chunk   each chunk's tokens numbered from 0 (rotary and mask)
  a future chunk is visible                 other shards' keys taken as position 0: no causal mask
                                            across chunks (the classic ring bug)
  the ring stops one step short             each query chunk meets cp - 1 K/V chunks, not cp
  the ring turns the wrong way              K/V sent to the previous shard, counted as from the
                                            next (cp >= 3: on 2 shards both ways are one permutation)
  ring permutes each step thrice            same values, 3x the collective-permutes (the
                                            communication check)
  chunk order undone on the way out         the logits put back into natural sequence order (and
                                            this shard's contiguous slice taken) before the loss
                                            meets the load-balanced targets
Blockwise attention (planted in ``model.blockwise`` while the sharded program is traced):
  online-softmax rescale skipped            the running sums not moved to a new running max
  a future block visible                    the causal mask from positions within the block pair
  kernel window off by one                  the kernel's window mask one key wider (i - W <= j)
  block-skip rule off by one                a K/V block skipped when its last key is the first
                                            query's oldest visible one (i - W + 1): only where a
                                            block ends exactly there (``_skip_edge_met``)
Soft-capping in the kernel and the ring (``attn_softcap`` > 0; planted in the variant's score rule,
``model.attention_variants``, and in ``model.context_parallel``'s ``_step_variant``):
  soft-cap applied after the softmax        the softmax's weights exp(s) capped, not its scores s
  soft-cap not applied in the backward      dS not multiplied by the cap's slope 1 - tanh^2 (the
                                            forward is right: only the gradients tell)
  cap missing on the ring's remote blocks   the ring's steps 1.. (the other shards' K/V chunks) attend
                                            to uncapped scores, forward and backward
"""

from __future__ import annotations

from contextlib import contextmanager

import jax.numpy as jnp
import numpy as np
from jax import lax

from meshlm.model import attention_variants, blockwise, context_parallel
from meshlm.parallel.axes import CP
from meshlm.parallel.context import Parallel
from meshlm.parallel.cp import chunk_positions, shard_order
from meshlm.proof.control_record import Control, Where


class RotaryRestartsPerChunk(Parallel):
    def positions(self, t_local: int):
        return jnp.tile(jnp.arange(t_local // 2), 2)


class FutureChunkVisible(Parallel):
    def kv_positions(self, origin, t_local: int):
        real = super().kv_positions(origin, t_local)
        return jnp.where(origin == self.cp_index(), real, jnp.zeros_like(real))


class RingOneStepShort(Parallel):
    def ring_steps(self) -> int:
        return self.layout.cp - 1


class RingReversed(Parallel):
    """K/V passed to the previous shard while each step's origin is counted as from the next one: on
    cp = 2 both directions are the same permutation (no proof can tell them apart there), from cp = 3 on
    the keys arrive with the wrong positions."""

    def cp_shift(self, x):
        cp = self.layout.cp
        return lax.ppermute(x, CP, [(i, (i - 1) % cp) for i in range(cp)])


class RingPermutesThrice(Parallel):
    """Each ring step's K/V travels forward, back and forward again: the same values, three times the
    collective-permutes (detected by the communication check only)."""

    def cp_shift(self, x):
        there = super().cp_shift(x)
        back = lax.ppermute(there, CP, [(i, (i - 1) % self.layout.cp) for i in range(self.layout.cp)])
        return super().cp_shift(back)


class ChunkOrderUndone(Parallel):
    def seq_out(self, x):
        full = lax.all_gather(x, CP, axis=1, tiled=True)  # [B, T, ...] chunks in shard order
        chunks = jnp.split(full, 2 * self.layout.cp, axis=1)
        order = shard_order(self.layout.cp)
        natural = jnp.concatenate([chunks[order.index(j)] for j in range(2 * self.layout.cp)], axis=1)
        t = x.shape[1]
        return lax.dynamic_slice_in_dim(natural, self.cp_index() * t, t, axis=1)


@contextmanager
def _planted(module=blockwise, **wrappers):
    """``module``'s functions (``model.blockwise``'s unless named) replaced, while the sharded program
    is traced, by ``wrapper(original)``: each fault calls the real function and changes one thing in
    its result, so a parameter the kernel adds later (as ``qs`` for the document mask) is passed
    through, not a ``TypeError`` when the control runs."""
    old = {name: getattr(module, name) for name in wrappers}
    try:
        for name, wrap in wrappers.items():
            setattr(module, name, wrap(old[name]))
        yield
    finally:
        for name, fn in old.items():
            setattr(module, name, fn)


def _no_rescale(rescale):
    """The running sums kept relative to the old max: a factor of one where exp(m_old - m_new) belongs."""
    return lambda m_old, m_new, *args, **kwargs: jnp.ones_like(rescale(m_old, m_new, *args, **kwargs))


def _block_local_mask(visible):
    """The causal mask from positions within the block pair (every other rule of ``_visible``, the
    document mask included, kept: it is the non-causal visibility of the same call)."""

    def planted(qp, kp, kvalid, causal, *args, **kwargs):
        vis = visible(qp, kp, kvalid, False, *args, **kwargs)
        local = (kp - kp[:, :1])[:, None, :] <= (qp - qp[:, :1])[:, :, None]
        return vis & local if causal else vis

    return planted


def _every_block_needed(needed):
    """Every block pair with a real key computed (as for non-causal attention): none skipped."""
    return lambda qp, kp, kvalid, causal, *args, **kwargs: needed(qp, kp, kvalid, False, *args, **kwargs)


def _window_wider(visible):
    """The kernel's window mask one key wider: ``_visible`` called with window + 1."""

    def planted(*args, window=None, **kwargs):
        return visible(*args, **kwargs, **({} if window is None else {"window": window + 1}))

    return planted


def _skip_narrower(needed):
    """The block-skip rule with window - 1: a block whose last key is exactly ``first query - window
    + 1`` (visible to that query alone) is skipped."""

    def planted(*args, window=None, **kwargs):
        return needed(*args, **kwargs, **({} if window is None else {"window": window - 1}))

    return planted


def _windowed_kernel(w: Where) -> bool:
    """The blockwise kernel runs with a window that some query's keys reach beyond."""
    return _blockwise_runs(w) and w.attention and 0 < w.cfg.sliding_window < w.seq_len


def _position_blocks(positions: np.ndarray, block: int) -> list[np.ndarray]:
    return [positions[i : i + block] for i in range(0, len(positions), block)]


def _skip_edge_met(w: Where) -> bool:
    """Whether some block pair of the sharded run has a K/V block ending exactly at its first query's
    oldest visible key (``first - window + 1``): only there is the skip rule's off-by-one visible. The
    query blocks are each cp shard's (its two chunks); the key blocks the ring's chunks, the gathered
    sequence (all-gather) or the whole sequence (no cp)."""
    if not _windowed_kernel(w):
        return False
    cp, t, block, window = w.layout.cp, w.seq_len, w.cfg.attn_block, w.cfg.sliding_window
    local = [np.arange(t)]  # without cp: one shard holding the whole sequence
    if w.layout.context_parallel:
        local = [np.asarray(chunk_positions(i, cp, t // cp)) for i in range(cp)]
    if w.layout.cp_ring or not w.layout.context_parallel:
        keys = [kb for p in local for kb in _position_blocks(p, min(block, len(p)))]
    else:
        keys = _position_blocks(np.concatenate(local), min(block, t))
    queries = [qb for p in local for qb in _position_blocks(p, min(block, len(p)))]
    edges = {int(qb.min()) - window + 1 for qb in queries}
    return any(int(kb.max()) in edges for kb in keys)


def _cap_after_softmax(score_mod):
    """The cap taken on the softmax's weights exp(s) instead of its scores s: the kernel then
    exponentiates log(cap(exp(s))), so each weight is cap * tanh(exp(s) / cap) (renormalised)."""
    return lambda s, variant, *args, **kwargs: (
        jnp.log(score_mod(jnp.exp(s), variant, *args, **kwargs)) if variant.softcap else s
    )


def _no_cap_slope(slope):
    """The backward's dS not multiplied by the cap's slope (the forward caps, its derivative is lost)."""
    return lambda s, variant, *args, **kwargs: 1.0


def _remote_blocks_uncapped(step_variant):
    """The ring's own chunk (step 0) capped, every chunk from another shard not."""

    def planted(variant, step, *args, **kwargs):
        own = step_variant(variant, step, *args, **kwargs)
        return own if step == 0 else own.replace(softcap=0.0)

    return planted


def _blockwise_runs(w: Where) -> bool:
    """The blockwise kernel runs: blockwise attention, or the ring's steps (but flash attention's ring
    steps are the flash kernel's, ``model.flash_ring``: these plants never meet them)."""
    if w.cfg is None or w.cfg.attention == "flash":
        return False
    return w.cfg.attention == "blockwise" or w.layout.cp_ring


def _capped(w: Where) -> bool:
    return w.cfg is not None and w.attention and bool(w.cfg.attn_softcap)


def _cap_in_kernel(w: Where) -> bool:
    """Soft-capped scores meet the blockwise kernel (blockwise attention, or the ring's steps)."""
    return _capped(w) and _blockwise_runs(w)


def _blocks_in_play(w: Where) -> bool:
    """The blockwise kernel runs (blockwise attention, or the ring's steps) on several K/V blocks."""
    if not (_blockwise_runs(w) and w.attention):
        return False
    return w.seq_len // w.layout.cp > w.cfg.attn_block


CP_CONTROLS: tuple[Control, ...] = (
    Control(
        name="online-softmax rescale skipped",
        applies=_blocks_in_play,
        plant=lambda: _planted(_rescale=_no_rescale),
    ),
    Control(
        name="a future block visible",
        applies=_blocks_in_play,
        plant=lambda: _planted(_visible=_block_local_mask, _needed=_every_block_needed),
    ),
    Control(
        name="kernel window off by one",
        applies=_windowed_kernel,
        plant=lambda: _planted(_visible=_window_wider),
    ),
    Control(
        name="block-skip rule off by one",
        applies=_skip_edge_met,
        plant=lambda: _planted(_needed=_skip_narrower),
    ),
    Control(
        name="soft-cap applied after the softmax",
        applies=_cap_in_kernel,
        plant=lambda: _planted(attention_variants, score_mod=_cap_after_softmax),
    ),
    Control(
        name="soft-cap not applied in the backward",
        applies=_cap_in_kernel,
        plant=lambda: _planted(attention_variants, score_mod_slope=_no_cap_slope),
    ),
    Control(
        name="cap missing on the ring's remote blocks",
        applies=lambda w: w.layout.cp_ring and _capped(w),  # either kernel's steps take _step_variant's cap
        plant=lambda: _planted(context_parallel, _step_variant=_remote_blocks_uncapped),
    ),
    Control(
        name="rotary positions restart in every chunk",
        applies=lambda w: w.layout.context_parallel and w.attention,
        par_cls=RotaryRestartsPerChunk,
    ),
    Control(
        name="a future chunk is visible",
        applies=lambda w: w.layout.context_parallel and w.attention,
        par_cls=FutureChunkVisible,
    ),
    Control(
        name="the ring stops one step short",
        applies=lambda w: w.layout.cp_ring and w.attention,
        par_cls=RingOneStepShort,
    ),
    Control(
        name="the ring turns the wrong way",
        applies=lambda w: w.layout.cp > 2 and w.attention and w.layout.cp_ring,
        par_cls=RingReversed,
    ),
    Control(
        name="chunk order undone on the way out",
        applies=lambda w: w.layout.context_parallel,
        par_cls=ChunkOrderUndone,
    ),
    Control(
        name="ring permutes each step thrice",
        applies=lambda w: w.layout.cp_ring and w.attention and w.collectives,
        par_cls=RingPermutesThrice,
        by_collectives=True,
    ),
)
