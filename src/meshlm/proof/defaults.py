"""``meshlm verify``'s default shapes, chosen to expose bugs rather than hide them (issue 36).

A held-out mutation test found classic bugs that the old defaults hid, each caught under a less
convenient shape. The defaults below are those shapes; a flag given explicitly is always kept:

* ``--microbatches``: 2 pp under ``--pp`` (M = pp hid a 1F1B stash one slot short: with as many
  micro-batches as stages no stage ever holds more than pp activations);
* ``--virtual-stages`` under ``--pp-schedule interleaved``: the smallest V >= 2 other than pp that
  splits the layers (pp == V made the chunk permutation its own inverse, so using it where its inverse
  belongs went unseen: pp 2 with V 2);
* the batch: one row per data shard per micro-batch (two rows hid a document-mask block skip that
  skips a block one row needs, because the skip is decided over the rows and the other row needed it);
* ``--attn-block`` when the blockwise kernel runs (``--attention blockwise``, or a ``--cp`` ring): blocks
  that cut each shard's sequence into several, the last of one row (with the old 512 every tiny proof
  had one block, and no block-skip, rescale or ragged path ran); with ``--attn-block`` given and no
  ``--seq-len``, a sequence length whose last block is ragged (block-aligned sequences hid an
  off-by-one in the causal block skip: it needs a last query block whose one query is its key block's
  first key); for a model with a sliding window (``window_shapes``), blocks and, unless ``--seq-len``
  is given, a sequence length such that a K/V block ends at some query block's first query - W + 1
  (21 at T = 64 never put one there, and hid an off-by-one in the window's block skip: that key is
  visible to the first query alone), the last block of one row kept where it can be (Gemma 2's global
  layers: the causal skip's edge too).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from meshlm.parallel.cp import shard_order


def microbatches(pp: int) -> int:
    """Micro-batches per step under ``--pp``: more than pp (2 pp: interleaved needs a multiple of pp)."""
    return 2 * pp


def virtual_stages(pp: int, cfg) -> int:
    """V for the interleaved schedule: the smallest V >= 2, V != pp, whose pp V chunks each run the same
    layers (``stage_layers.stage_problem``: equal chunks, and of a stack of two kinds whole periods);
    2 where none does (``rules.check_uniform_stack`` then says what fits)."""
    from meshlm.model.stage_layers import stage_problem

    fits = [v for v in range(2, cfg.n_layers // pp + 1) if v != pp and stage_problem(cfg, pp * v, v) is None]
    return fits[0] if fits else 2


def batch_rows(dp: int, microbatches: int) -> int:
    """The proof's global batch: one row per data shard in each micro-batch."""
    return dp * microbatches


def block_for(local_len: int) -> int:
    """Blocks for a shard's ``local_len`` tokens: the largest block that cuts them into at least 3 full
    blocks and a last block of one row, else into 2 and one, else ``local_len - 1`` (one full block
    and one row; 1 for fewer than 3 tokens)."""
    for full in (3, 2):
        fits = [b for b in range(2, local_len // full + 1) if local_len % b == 1]
        if fits:
            return fits[-1]
    return max(local_len - 1, 1)


def ragged_seq_len(default: int, block: int, cp: int, valid: Callable[[int], bool]) -> int:
    """The longest sequence length <= ``default`` that the layout accepts (``valid``) whose per-shard
    length (T / cp) leaves a last block of one row, else any ragged last block; else ``default``."""
    lengths = seq_lens(default, cp, valid)
    for ragged in (lambda r: r == 1, lambda r: r != 0):
        for t in lengths:
            if ragged((t // cp) % block):
                return t
    return default


def seq_lens(default: int, cp: int, valid: Callable[[int], bool]) -> list[int]:
    """The sequence lengths <= ``default`` the layout accepts (``valid``, a multiple of cp), longest first."""
    return [t for t in range(default, 1, -1) if valid(t) and t % cp == 0]


# The block rules a windowed model's shapes keep where they can, best first: on (full blocks a shard,
# rows of its last block), at least 3 full blocks and a last of one row, 2 and one, any ragged last, any.
_WINDOW_TIERS = (
    lambda full, rest: full >= 3 and rest == 1,
    lambda full, rest: full >= 2 and rest == 1,
    lambda full, rest: full >= 2 and rest != 0,
    lambda full, rest: full >= 2,
)


def window_shapes(
    lengths: Sequence[int], cp: int, meets: Callable[[int, int], bool]
) -> tuple[int, int] | None:
    """For a model with a sliding window: (sequence length, block), the length one of ``lengths`` (one
    when ``--seq-len`` is given), whose blocks meet the window's edge (``meets(t, block)``: some K/V
    block ends at a query block's first query - W + 1: ``window_edge_met``), the
    first rule of ``_WINDOW_TIERS`` that some pair keeps, then the largest block, then the longest
    length. None when no block meets the edge (e.g. W = 3 without cp: it needs blocks of 1)."""
    longest = max(lengths, default=0) // cp
    for tier in _WINDOW_TIERS:
        for block in range(longest // 2, 1, -1):
            for t in lengths:
                if tier(t // cp // block, t // cp % block) and meets(t, block):
                    return t, block
    return None


def window_edge_met(t: int, block: int, *, window: int, layout) -> bool:
    """Whether some K/V block ends exactly at some query block's first query - ``window`` + 1 (only
    there is the window's block-skip off-by-one visible), on T = ``t`` in blocks of ``block``: query
    blocks each cp shard's (its two chunks, ``parallel.cp``), key blocks the ring's chunks, the
    gathered sequence (the all-gather) or the whole sequence (no cp) of ``layout``. The positions the
    block-skip control's ``applies`` works out (``cp_controls._skip_edge_met``, with jax arrays: this
    runs before the devices exist); tests/test_verify_defaults.py holds the two to agreement."""
    if not 0 < window < t:
        return False
    cp = layout.cp if layout.context_parallel else 1
    gathered = layout.context_parallel and not layout.cp_ring  # the all-gather: keys in one sequence
    c = t // (2 * cp)
    chunks = [np.arange(j * c, j * c + c) for j in shard_order(cp)]
    local = [np.concatenate(chunks[2 * i : 2 * i + 2]) for i in range(cp)]
    local = local if layout.context_parallel else [np.arange(t)]  # no cp: one shard, any T
    cut = lambda p: [p[i : i + block] for i in range(0, len(p), min(block, len(p)))]
    keys = cut(np.concatenate(local)) if gathered else [kb for p in local for kb in cut(p)]
    edges = {int(qb.min()) - window + 1 for p in local for qb in cut(p)}
    return any(int(kb.max()) in edges for kb in keys)
