"""Multi-token prediction's config fields (DeepSeek-V3, Kimi K2: ``num_nextn_predict_layers``; the
modules: ``model.mtp``).

A base of ``ModelConfig`` (as ``MoEFields``). ``mtp_layers`` = D modules after the main model, depth
d = 1..D predicting the token d + 1 ahead; ``mtp_weight`` is DeepSeek-V3's lambda: the training loss
is the main loss + lambda / D x the sum of the D depths' losses (the paper's eq. 25: L_MTP = lambda / D
sum_k L_MTP^k; lambda 0.3 for its first 10T tokens, then 0.1). 0: the modules are kept (convert,
export) but not run. A config saved without these fields predates MTP: none.

This module must not import JAX: configs are validated before devices exist.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshlm.errors import ConfigError
from meshlm.ranges import NON_NEGATIVE_FLOAT, Range


@dataclass(frozen=True)
class MTPFields:
    mtp_layers: int = 0  # D: multi-token prediction depths (transformers' num_nextn_predict_layers)
    mtp_weight: float = 0.0  # lambda: the depths' losses' weight (their sum x lambda / D); 0: not run

    @property
    def mtp_on(self) -> bool:
        """Whether the training loss runs the MTP modules (they exist and are weighted)."""
        return self.mtp_layers > 0 and self.mtp_weight > 0


MTP_RANGES = {
    "mtp_layers": Range(int, 0, note="0: none"),
    "mtp_weight": NON_NEGATIVE_FLOAT,
}


def check_mtp(cfg) -> None:
    """MTP needs a transformer with a final norm and layers of one kind (its block is the family's main
    layer: DeepSeek-V3's MLA + MoE); a weight needs modules to weigh."""
    if cfg.mtp_weight and not cfg.mtp_layers:
        raise ConfigError(
            f"mtp_weight={cfg.mtp_weight} needs multi-token prediction layers (mtp_layers >= 1: "
            "num_nextn_predict_layers); this model has none (a DeepSeek-V3 that transformers saved converts "
            "without them): drop --mtp-weight or set it to 0"
        )
    if cfg.mtp_on and cfg.loss_chunk:  # ``model.loss_fields``
        raise ConfigError(
            f"--loss-chunk does not chunk the multi-token prediction depths' losses yet (mtp_layers="
            f"{cfg.mtp_layers}); drop --loss-chunk or pass --mtp-weight 0"
        )
    if cfg.mtp_layers and (not cfg.arch.attention or cfg.arch.norm is None or cfg.full_attn_every):
        raise ConfigError(
            f"mtp_layers={cfg.mtp_layers} needs a transformer family with a final norm and no linear-"
            "attention layers (DeepSeek-V3's); set mtp_layers=0"
        )


def as_layers(cfg):
    """``cfg`` as the collective and memory formulas count its blocks (``perf.collectives``): with MTP on,
    each depth's block one more layer of the main kind (DeepSeek-V3's: MLA + MoE); else ``cfg``."""
    return cfg.replace(n_layers=cfg.n_layers + cfg.mtp_layers) if cfg.mtp_on else cfg
