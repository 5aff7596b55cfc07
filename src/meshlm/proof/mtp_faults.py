"""Planted faults of multi-token prediction (``model.mtp``; ``proof.controls`` runs them), each
replacing one of ``model.mtp``'s points while the sharded run traces: the tokens a depth embeds one
position too few ahead (t_{i+d-1}: depth 1 re-embeds the main model's own input), and the depths'
labels shifted inside this shard's chunks of the sequence instead of on the whole sequence (the
labels near a cp chunk's end would be the next chunk's first tokens: they become wrong ones)."""

from __future__ import annotations

from meshlm.model import mtp
from meshlm.proof.control_record import Control, Where, replaced


def _one_too_few(inputs, targets, d: int):
    return mtp.ahead(inputs, d - 1)  # t_{i+d-1}: the correct t_{i+d} is targets shifted by d - 1


def _labels_inside_the_shard(par, targets, d: int):
    return mtp.ahead(par.seq_local(targets), d)


def _mtp(w: Where) -> bool:
    return w.cfg is not None and w.cfg.mtp_on


MTP_CONTROLS = (
    Control(
        name="MTP token shifted by one too few",
        applies=_mtp,
        plant=lambda: replaced(vars(mtp), "depth_ids", _one_too_few),
    ),
    Control(
        name="MTP labels not taken across the cp shard boundary",
        applies=lambda w: _mtp(w) and w.layout.context_parallel,
        plant=lambda: replaced(vars(mtp), "depth_labels", _labels_inside_the_shard),
    ),
)
