"""The data pipeline, proven: the global batch the mesh trains on equals the one-device batch.

``meshlm train`` never builds a global batch on one host: each device asks for its own rows
(``data.device_batches``), and each process reads only its own. A wrong row offset there would not
show in any gradient comparison (both runs would see the same wrong batch). So the proof assembles
the global batch from the per-device rows (gathered from every process) and compares it bitwise
with ``Batcher.batch(step)`` built on one host, for several steps, with and without gradient
accumulation (whose micro-batch-major layout is the subtle part), on its own batch of
``ROWS_PER_SHARD`` rows per data shard per micro-batch (not the proof's small one).
"""

from __future__ import annotations

import numpy as np

from meshlm.data.device_batches import device_batch
from meshlm.data.stream import Batcher, TokenStream
from meshlm.parallel.layout import Layout
from meshlm.parallel.placement import to_host
from meshlm.proof.report import check_row

STREAM_TOKENS = 4096  # a synthetic byte stream: the proof is about placement, not file reading
# Rows per data shard per micro-batch in the check's own batch. With one row, a shard's rows of a
# micro-batch are a single row, and a wrong reshape of the accumulation rows (micro-batch-major vs
# row-major) agrees with the right one; with three every transposition shows.
ROWS_PER_SHARD = 3


def one_device_batch(batcher: Batcher, step: int, accum: int) -> dict[str, np.ndarray]:
    """The step's global batch on one host, in the layout the step consumes: [B, T], or
    [A, B/A, T] with accumulation where global row r*A + a is micro-batch a's row r."""
    full = batcher.batch(step)
    if accum == 1:
        return full
    rows = batcher.global_batch // accum
    return {k: v.reshape(rows, accum, -1).transpose(1, 0, 2) for k, v in full.items()}


def data_checks(
    where, *, batch: int | None = None, seq_len: int, steps: int = 3, seed: int = 0
) -> list[dict]:
    """One row per accumulation setting that ``batch`` allows on ``where`` (a Layout or a jax Mesh): 1,
    and 2 when it splits. ``batch`` defaults to the check's own: ``ROWS_PER_SHARD`` rows per data shard
    per micro-batch."""
    layout = Layout.of(where)
    dp = layout.dp
    batch = ROWS_PER_SHARD * 2 * dp if batch is None else batch
    stream = TokenStream(np.random.default_rng(seed).integers(0, 256, STREAM_TOKENS))
    rows = []
    for accum in (1, 2):
        if batch % (accum * dp):
            continue
        batcher = Batcher(stream, seq_len, batch, seed)
        bad = [
            step
            for step in range(steps)
            if not _equal(device_batch(batcher, step, layout, accum), one_device_batch(batcher, step, accum))
        ]
        detail = (
            f"steps {bad} differ from the one-device batch"
            if bad
            else f"{steps} steps of {batch} x {seq_len}: per-device rows assemble to the one-device batch"
        )
        rows.append(check_row(f"data pipeline (accumulation {accum})", not bad, detail))
    return rows


def _equal(placed: dict, want: dict) -> bool:
    return all(np.array_equal(to_host(placed[k]), want[k]) for k in want)
