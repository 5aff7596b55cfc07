"""Planted faults of the chunked cross-entropy (``model.chunked_xent``, ``--loss-chunk``;
``proof.controls`` runs them): the head's weight gradient overwritten by each chunk's instead of summed
over the chunks (``acc = d`` for ``acc += d``: the model then learns from the last chunk's tokens alone)."""

from __future__ import annotations

import jax

from meshlm.model import chunked_xent
from meshlm.proof.control_record import Control, Where, replaced


def _last_chunk_only(acc, grads):
    return jax.tree.map(lambda a, d: d.astype(a.dtype), acc, grads)


def _chunks(w: Where) -> bool:
    """More than one chunk per shard (every shard holds at least one row of T / cp tokens) and a head
    that trains (LoRA freezes it: its gradient is not used)."""
    if w.cfg is None or not w.cfg.loss_chunk or w.cfg.lora_rank:
        return False
    return w.cfg.loss_chunk < w.seq_len // w.layout.cp


LOSS_CONTROLS = (
    Control(
        name="chunked loss: head gradient of the last chunk only",
        applies=_chunks,
        plant=lambda: replaced(vars(chunked_xent), "_accumulate", _last_chunk_only),
    ),
)
