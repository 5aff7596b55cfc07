"""``TrainConfig``'s objective settings (a base, as ``MoESettings``): the language-model loss or DPO.

This module must not import JAX: the CLI builds its parser from it before choosing devices.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshlm.ranges import POSITIVE_FLOAT
from meshlm.settings import setting

OBJECTIVES = ("lm", "dpo")
DPO_LOSSES = ("sigmoid", "ipo")  # ``model.preference.LOSSES`` (that module imports JAX)


@dataclass(frozen=True)
class ObjectiveSettings:
    objective: str = setting(
        "lm",
        "lm: next-token loss on --data's text (or a chat store's mask); dpo: DPO on --data's "
        "(prompt, chosen, rejected) pairs against the starting weights, frozen (docs/training.md, DPO)",
        resume_must_match=True,
        choices=OBJECTIVES,
    )
    dpo_beta: float = setting(
        0.1,
        "DPO's beta (IPO's tau): the strength of the pull to the reference",
        resume_must_match=True,
        valid=POSITIVE_FLOAT,
    )
    dpo_loss: str = setting(
        "sigmoid",
        "DPO's loss: sigmoid (DPO) or ipo (IPO, length-normalized as trl)",
        resume_must_match=True,
        choices=DPO_LOSSES,
    )
