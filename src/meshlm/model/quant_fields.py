"""``ModelConfig.quant``'s values and what they cover (no JAX here: the config imports it).

``model.quant`` computes; this module only checks, before any work.
"""

from __future__ import annotations

from meshlm.errors import ConfigError

QUANTS = ("none", "int8")


def check_quant(cfg, layout=None) -> None:
    """What ``--quant int8`` covers: one line naming the problem and the fix, before any work."""
    if cfg.quant not in QUANTS:
        raise ConfigError(f"quant must be one of {', '.join(QUANTS)}, got {cfg.quant!r}")
    if cfg.quant == "none":
        return
    unsupported = (
        (cfg.arch.moe, "a mixture of experts (experts are not quantized yet)"),
        (bool(cfg.lora_rank), "LoRA adapters"),
    )
    for bad, what in unsupported:
        if bad:
            raise ConfigError(f"--quant {cfg.quant} does not support {what}; use --quant none")
    if layout is None:
        return
    if layout.pp > 1:
        raise ConfigError(
            f"--quant {cfg.quant} with --pp {layout.pp}: the gradient scales are a max over the whole "
            "batch, which the pipeline's micro-batches split; use --pp 1"
        )
    kv = cfg.kv_heads
    if cfg.arch.attention and layout.mp > kv:
        raise ConfigError(
            f"--quant {cfg.quant} with mp={layout.mp} > n_kv_heads={kv} (replicated KV heads): their "
            f"gradient is a sum over shards of partial gradients, not one quantized matmul; use mp <= {kv}"
        )
