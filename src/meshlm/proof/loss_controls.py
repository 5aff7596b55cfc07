"""Planted faults of the chunked cross-entropy (``model.chunked_xent``, ``--loss-chunk``;
``proof.controls`` runs them). Its forward computes the gradients chunk by chunk and its backward only
scales them, so each fault is one a fused loss can make:

* the head's weight gradient overwritten by each chunk's instead of summed over the chunks (``acc = d``
  for ``acc += d``: the model then learns from the last chunk's tokens alone);
* the stored gradients returned as they are, not times the backward's cotangent (the loss is the sum
  over the chunks divided by the tokens outside the custom VJP, so the cotangent is 1 / N at least:
  every mesh and every chunk size shows it);
* the chunks stitched back one chunk off: chunk j's rows get chunk j-1's hidden-row gradients
  (dlogits_{j-1} @ W^T) and per-token losses.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from meshlm.model import chunked_xent
from meshlm.proof.control_record import Control, Where, replaced


def _last_chunk_only(acc, grads):
    return jax.tree.map(lambda a, d: d.astype(a.dtype), acc, grads)


def _unscaled(g, grad, dtype):
    return grad.astype(dtype)


def _one_chunk_off(a, n: int):
    return jnp.roll(a, 1, axis=0).reshape(-1, *a.shape[2:])[:n]


def _chunked(w: Where) -> bool:
    return w.cfg is not None and bool(w.cfg.loss_chunk)


def _several(w: Where) -> bool:
    """More than one chunk per shard (every shard holds at least one row of T / cp tokens)."""
    return _chunked(w) and w.cfg.loss_chunk < w.seq_len // w.layout.cp


def _head_trains(w: Where) -> bool:
    """Several chunks and a head that trains (LoRA freezes it: no weight gradient is computed)."""
    return _several(w) and not w.cfg.lora_rank


LOSS_CONTROLS = (
    Control(
        name="chunked loss: head gradient of the last chunk only",
        applies=_head_trains,
        plant=lambda: replaced(vars(chunked_xent), "_accumulate", _last_chunk_only),
    ),
    Control(
        name="chunked loss: stored gradients not scaled by the cotangent",
        applies=_chunked,
        plant=lambda: replaced(vars(chunked_xent), "_scaled", _unscaled),
    ),
    Control(
        name="chunked loss: chunks stitched back one chunk off",
        applies=_several,
        plant=lambda: replaced(vars(chunked_xent), "_unchunked", _one_chunk_off),
    ),
)
