"""Per-device memory of a model on a mesh, from shapes alone (``jax.eval_shape``: nothing allocated),
so that real-size presets (gptj-6b, llama2-7b) can be planned on a laptop."""

from __future__ import annotations

import jax
import numpy as np

from meshlm.model.config import ModelConfig
from meshlm.parallel.layout import Layout
from meshlm.parallel.placement import bytes_per_device, total_bytes


def memory_report(cfg: ModelConfig, where, param_dtype=np.float32) -> dict:
    """Bytes of parameters and AdamW state (2 moments), total and on one device, by sharding rules,
    on ``where`` (a Layout or a jax Mesh)."""
    from meshlm.io.model_io import abstract_params
    from meshlm.model.accounting import count_params

    layout = Layout.of(where)
    params = abstract_params(cfg, layout, param_dtype)
    leaves = jax.tree.leaves(params)
    total, per_device = total_bytes(params), bytes_per_device(params)
    replicated = total_bytes([p for p in leaves if p.sharding.is_fully_replicated])
    mp = layout.mp
    counts = count_params(cfg, params)  # the padded vocabulary's, as stored
    return {
        "params": counts.total,
        "active_params": counts.active,  # a token's: k of E experts (model.accounting)
        "param_bytes_total": total,
        "param_bytes_per_device": per_device,
        "param_bytes_ideal_per_device": (total - replicated) / mp + replicated,
        "adam_state_bytes_per_device": 2 * per_device,
        "train_state_bytes_per_device": 3 * per_device,
    }
