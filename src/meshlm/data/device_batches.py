"""Host batches to global device arrays: each device's rows are built where they are needed.

``jax.make_array_from_callback`` asks for the rows of each addressable device only, so a process (and
a data-parallel shard) reads just its slice of the batch; the batch at step s is a pure function of
(seed, s), which makes the loader resumable without state.
"""

from __future__ import annotations

import jax
import numpy as np

from meshlm.data.stream import Batcher
from meshlm.parallel.placement import batch_sharding, put_global


def _rows(batcher: Batcher, step: int, rows: slice, total: int, accum: int, cache: dict) -> dict:
    """Host rows [rows] of the [accum, total, T] step batch (micro-batch major)."""
    start, stop = rows.start or 0, total if rows.stop is None else rows.stop
    width = stop - start
    key = (start, width)
    if key not in cache:
        b = batcher.batch(step, shard=start // width, num_shards=total // width)
        # Global row r*accum + a is micro-batch a's row r: a shard's rows are contiguous for every a.
        cache[key] = {k: v.reshape(width, accum, -1).transpose(1, 0, 2) for k, v in b.items()}
    return cache[key]


def device_batch(batcher: Batcher, step: int, layout, accum: int) -> dict:
    """{"inputs", "targets"} (and a chat store's "loss_mask"): global [B, T] (or [A, B/A, T] with
    accumulation), rows over DP."""
    total = batcher.global_batch // accum
    shape = (total, batcher.seq_len) if accum == 1 else (accum, total, batcher.seq_len)
    sharding = batch_sharding(layout, accum)
    cache: dict = {}

    def make(key):
        def cb(index):
            rows = index[0] if accum == 1 else index[1]
            part = _rows(batcher, step, rows, total, accum, cache)[key]  # [A, rows, T]
            return np.ascontiguousarray(part[0] if accum == 1 else part)

        return jax.make_array_from_callback(shape, sharding, cb)

    return {k: make(k) for k in batcher.keys}


def eval_arrays(batches: list[dict], layout) -> list[dict]:
    """Validation batches placed once on the ``Layout``'s mesh, rows over DP."""
    sharding = batch_sharding(layout, 1)
    return [{k: put_global(v, sharding) for k, v in b.items()} for b in batches]
