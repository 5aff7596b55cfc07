"""``TrainConfig``'s objective settings (a base, as ``MoESettings``): the language-model loss or DPO.

This module must not import JAX: the CLI builds its parser from it before choosing devices.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshlm.ranges import Range
from meshlm.settings import setting

OBJECTIVES = ("lm", "dpo")
DPO_LOSSES = ("sigmoid", "ipo")  # ``model.preference.LOSSES`` (that module imports JAX)
# beta's range, three orders of magnitude either side of DPO's usual 0.01-0.5 (trl's default 0.1). Beyond
# it float32 overflows: DPO's gradient is beta x sigma(-beta x margin), beta / 2 per pair at the first
# step (the policy is the reference), and at 1e30 its weighted gradient pass and clip norm are inf;
# IPO's loss is (margin - 1 / (2 tau))^2, inf below tau ~ 1e-19. Zero or less: no pull at all.
DPO_BETA = Range(float, 1e-3, 1e3, note="DPO's usual 0.01-0.5")


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
        valid=DPO_BETA,
    )
    dpo_loss: str = setting(
        "sigmoid",
        "DPO's loss: sigmoid (DPO) or ipo (IPO, length-normalized as trl)",
        resume_must_match=True,
        choices=DPO_LOSSES,
    )
