"""The training loss's config field of how it runs (a base of ``ModelConfig``, as ``MTPFields``).

``loss_chunk``: the head's cross-entropy in chunks of at most that many tokens, its gradients computed
chunk by chunk in the forward, so the [B, T, V/mp] float32 logits never exist whole
(``model.chunked_xent``; ``--loss-chunk`` on train, bench, plan and verify). 0: off, and a config saved
without the field loads as 0. Like ``attention`` it changes memory and speed, never values: the proof's
reference runs 0 (``proof.problem``), and multi-token prediction, whose depths' losses it does not
chunk, refuses it (``mtp_fields.check_mtp``).

This module must not import JAX: configs are validated before devices exist.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshlm.ranges import Range


@dataclass(frozen=True)
class LossFields:
    loss_chunk: int = 0  # tokens per chunk of the head's cross-entropy; 0: the whole logits at once


LOSS_RANGES = {"loss_chunk": Range(int, 0, note="0: off")}
