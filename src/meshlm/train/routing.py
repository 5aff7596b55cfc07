"""A mixture of experts' per-step routing metrics (metrics.jsonl and TensorBoard), from the routing
statistics the train step returns beside its loss (``model.moe.statistics``, summed over the step's
global batch: ``make_step``'s metrics["routing"], [L, 2E + 3]; under --accum-steps summed over the
micro-batches). Read from values the loss computed anyway: nothing changes the loss or the gradients.

  expert_load            [E] token-choices per expert in the step's global batch, the mean over the
                         MoE layers (k choices per token, counted before the capacity drops any: the
                         router's choice); sums to tokens x k
  expert_load_min/_max   its smallest and largest entry
  expert_load_cv         its coefficient of variation (std / mean over experts; 0: perfectly balanced)
  moe_dropped            token-choices the capacity dropped, all layers together (0: dropless)
  moe_dropped_fraction   that over all the layers' token-choices (tokens x k x layers)
  moe_aux_loss_<conv>    the load-balancing loss in the model's convention (hf: pooled over layers, ~k
                         balanced; per_layer: Megatron's, ~1), before its coefficient; over a step of
                         several micro-batches it is that of their summed statistics
"""

from __future__ import annotations

import numpy as np

from meshlm.model import moe


def routing_row(cfg, stats) -> dict:
    """metrics.jsonl entries of one step's routing statistics ``stats`` [L, 2E + 3] (host or device)."""
    stats = np.asarray(stats, dtype=np.float64)
    counts, _, _, tokens = moe.split_stats(cfg, stats)  # [L, E], [L]
    dropped = float(moe.dropped_choices(cfg, stats).sum())
    load = counts.mean(axis=0)
    mean = float(load.mean())
    conv = cfg.moe_aux_loss.replace("-", "_")
    return {
        "expert_load": [float(x) for x in load],
        "expert_load_min": float(load.min()),
        "expert_load_max": float(load.max()),
        "expert_load_cv": float(load.std() / mean) if mean else 0.0,
        "moe_dropped": dropped,
        "moe_dropped_fraction": dropped / float(tokens.sum() * cfg.experts_per_token),
        f"moe_aux_loss_{conv}": float(moe.balance_loss(cfg, stats)),
    }
