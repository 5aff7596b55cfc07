"""Planted faults of multi-token prediction (``model.mtp``; ``proof.controls`` runs them), each
replacing one of ``model.mtp``'s points while the sharded run traces: the tokens a depth embeds one
position too few ahead (t_{i+d-1}: depth 1 re-embeds the main model's own input), and the depths'
labels shifted inside this shard's chunks of the sequence instead of on the whole sequence (the
labels near a cp chunk's end would be the next chunk's first tokens: they become wrong ones), and under
pp the depths' loss term counted on every pipeline stage instead of the last one's alone."""

from __future__ import annotations

from meshlm.model import mtp
from meshlm.proof.control_record import Control, Where, replaced


def _one_too_few(inputs, targets, d: int):
    return mtp.ahead(inputs, d - 1)  # t_{i+d-1}: the correct t_{i+d} is targets shifted by d - 1


def _labels_inside_the_shard(par, targets, d: int):
    return mtp.ahead(par.seq_local(targets), d)


_WEIGHTED = mtp.weighted


def _on_every_stage(cfg, par, per_depth):
    # as a step whose every stage adds the depths' loss it is handed (the last stage's, sent on) before
    # the step's sum over the stages: pp times the term (the main loss the last stage's alone)
    return par.layout.pp * _WEIGHTED(cfg, par, per_depth)


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
    Control(
        name="MTP loss counted on every pp stage",
        applies=lambda w: _mtp(w) and w.layout.pipelined,
        plant=lambda: replaced(vars(mtp), "weighted", _on_every_stage),
    ),
)
