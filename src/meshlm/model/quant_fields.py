"""``ModelConfig.quant``'s values and what they cover (no JAX here: the config imports it).

``model.quant`` computes; this module only checks, before any work.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshlm.errors import ConfigError
from meshlm.settings import setting

QUANTS = ("none", "int8")


@dataclass(frozen=True)
class QuantFields:
    """``ModelConfig``'s ``quant`` (a base, as ``MoEFields``)."""

    # The weight matmuls of attention, the MLP and the experts as int8 x int8 -> int32, forward and backward
    # (``model.quant``): "int8"; "none": float. A model fact (it trains to other weights): saved with the
    # run, so evaluating or generating from a model so trained quantizes as it trained. A config saved
    # without it predates it: "none".
    quant: str = "none"


@dataclass(frozen=True)
class QuantSettings:
    """train's --quant (a base of ``TrainConfig``, as ``LoraSettings``): recorded in the run's model."""

    quant: str = setting(
        "none",
        "the weight matmuls of attention, MLP and experts as int8 x int8 -> int32, forward and backward "
        "(docs/quantization.md); saved with the model",
        resume_must_match=True,
        choices=QUANTS,
    )


def check_quant(cfg, layout=None) -> None:
    """What ``--quant int8`` covers: one line naming the problem and the fix, before any work."""
    if cfg.quant not in QUANTS:
        raise ConfigError(f"quant must be one of {', '.join(QUANTS)}, got {cfg.quant!r}")
    if cfg.quant == "none":
        return
    if cfg.lora_rank:
        raise ConfigError(f"--quant {cfg.quant} does not support LoRA adapters; use --quant none")
    if cfg.arch.moe and cfg.moe_dispatch == "gmm":
        raise ConfigError(
            f"--quant {cfg.quant} with --moe-dispatch gmm: its Pallas kernel multiplies bfloat16 and "
            "float32, not int8; use --moe-dispatch ragged_dot (or blocks, or auto)"
        )
    if layout is None:
        return
    if layout.pp > 1 and cfg.arch.moe:
        raise ConfigError(
            f"--quant {cfg.quant} with --pp {layout.pp} on a mixture of experts: not proven (under pp the "
            "int8 scales are each micro-batch's, and the proof's micro-batched reference does not form the "
            "routing losses from the whole batch's statistics as the pipeline does); use --pp 1"
        )
    kv = cfg.kv_heads
    if cfg.arch.attention and layout.mp > kv:
        raise ConfigError(
            f"--quant {cfg.quant} with mp={layout.mp} > n_kv_heads={kv} (replicated KV heads): their "
            f"gradient is a sum over shards of partial gradients, not one quantized matmul; use mp <= {kv}"
        )
