"""DPO's objective on sequence log-prob sums (Rafailov et al. 2023; IPO: Azar et al. 2023).

A preference batch is rows in pairs: row 2i the chosen completion of pair i, row 2i + 1 its rejected
one (global [B, T], B = 2 x pairs), each row its prompt and completion, with ``completion_mask`` 1 on
the targets that are completion tokens. A row's log-prob is the sum over those targets of log p(target)
(``sequence_logps``): under the policy and under the frozen reference. The formulas are trl's
(``DPOTrainer._compute_loss``, trl 1.16; tested equal to it in float64):

* sigmoid: -log σ(β ((πc - ρc) - (πr - ρr)))
* ipo:     ((πc - ρc) / |c| - (πr - ρr) / |r| - 1 / (2β))², |c|, |r| the completion lengths (trl
  normalises IPO's log-ratios by them, as the IPO authors' reported runs did)

averaged over the pairs of the step. Rewards: β (π - ρ) per row; reward accuracy the fraction of pairs
whose chosen reward exceeds the rejected one (strictly, as trl).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.nn import log_sigmoid

COMPLETION_MASK = "completion_mask"  # the batch entry: 1 on a target that is a completion token
REF_LOGPS = "ref_logps"  # the batch entry: the reference's per-target log-probs (0 off the completion)
LOSSES = ("sigmoid", "ipo")


def sequence_logps(per_token_logp, mask):
    """[B, T] per-target log-probs and the 0/1 completion mask -> [B] their sums over the completion."""
    return jnp.sum(per_token_logp * mask.astype(per_token_logp.dtype), axis=-1)


def pairs(rows):
    """[B] per row -> ([P] chosen, [P] rejected): rows 2i and 2i + 1."""
    return rows[0::2], rows[1::2]


def dpo_losses(policy, reference, lengths, beta: float, loss: str):
    """[P] per-pair losses from [B] row sums of the policy and the reference (rows in pairs) and the
    rows' completion lengths [B] (IPO's normaliser)."""
    ratio = policy - reference
    if loss == "ipo":
        ratio = ratio / jnp.maximum(lengths.astype(ratio.dtype), 1)
    chosen, rejected = pairs(ratio)
    delta = chosen - rejected
    if loss == "sigmoid":
        return -log_sigmoid(beta * delta)
    if loss == "ipo":
        return (delta - 1 / (2 * beta)) ** 2
    raise ValueError(f"unknown DPO loss {loss!r}; choose one of {', '.join(LOSSES)}")


def dpo_loss(policy, reference, lengths, beta: float, loss: str):
    """The step's loss: the mean over its pairs (``dpo_losses``)."""
    return jnp.mean(dpo_losses(policy, reference, lengths, beta, loss))


def dpo_metrics(policy, reference, beta: float) -> dict:
    """The step's reward statistics (means over its pairs), as trl logs them."""
    rewards = beta * (policy - reference)
    chosen, rejected = pairs(rewards)
    pc, pr = pairs(policy)
    return {
        "reward_accuracy": jnp.mean((chosen > rejected).astype(rewards.dtype)),
        "reward_margin": jnp.mean(chosen - rejected),
        "reward_chosen": jnp.mean(chosen),
        "reward_rejected": jnp.mean(rejected),
        "logps_chosen": jnp.mean(pc),
        "logps_rejected": jnp.mean(pr),
    }
