"""Multi-head latent attention's config fields (DeepSeek-V2/V3, Kimi K2; ``model.mla`` computes it).

A base of ``ModelConfig`` (as ``MoEFields``): ``kv_lora_rank`` > 0 makes every layer's attention MLA.
The query/key head is ``head_dim`` wide (transformers' qk_nope_head_dim + qk_rope_head_dim), its last
``rotary_dim`` dims the rotary part (qk_rope_head_dim) and the rest the per-head non-rotary part; the
values are ``v_head_dim`` wide. A config saved without these fields predates MLA: 0, none.

This module must not import JAX: configs are validated before devices exist.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshlm.errors import ConfigError
from meshlm.ranges import Range


@dataclass(frozen=True)
class MLAFields:
    q_lora_rank: int = 0  # the queries' low-rank width (q down, norm, q up); 0: one plain q projection
    kv_lora_rank: int = 0  # the keys' and values' shared latent width; 0: not MLA
    v_head_dim: int = 0  # the values' head width (MLA only; <= head_dim)

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0


MLA_RANGES = {
    "q_lora_rank": Range(int, 0, note="0: a plain q projection"),
    "kv_lora_rank": Range(int, 0, note="0: not MLA"),
    "v_head_dim": Range(int, 0, note="0: not MLA"),
}


def check_mla(cfg) -> None:
    """MLA's fields agree: a latent, explicit q/k and v head widths, a rotary part shorter than the
    head, one KV head per query head (the latent is shared; n_kv_heads 0 or n_heads), no window."""
    if not cfg.mla:
        if cfg.q_lora_rank or cfg.v_head_dim:
            raise ConfigError("q_lora_rank and v_head_dim are MLA's: set kv_lora_rank > 0, or them to 0")
        return
    if not cfg.arch.attention or not cfg.head_dim or not 0 < cfg.v_head_dim <= cfg.head_dim:
        raise ConfigError(
            f"MLA (kv_lora_rank={cfg.kv_lora_rank}) needs attention, head_dim (qk_nope + qk_rope) set and "
            f"0 < v_head_dim <= head_dim; got head_dim={cfg.head_dim}, v_head_dim={cfg.v_head_dim}"
        )
    if not 0 < cfg.rotary_dim < cfg.head_dim or cfg.kv_heads != cfg.n_heads:
        raise ConfigError(
            f"MLA needs 0 < rotary_dim (qk_rope_head_dim) < head_dim and n_kv_heads 0 or n_heads; got "
            f"rotary_dim={cfg.rotary_dim}, head_dim={cfg.head_dim}, n_kv_heads={cfg.n_kv_heads}"
        )
    for name in ("sliding_window", "global_every", "attn_scalar", "rope_linear"):
        if getattr(cfg, name):
            raise ConfigError(f"{name}={getattr(cfg, name)} is not built for MLA; set {name}=0")
