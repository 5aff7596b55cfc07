"""``ModelConfig``'s LoRA fields and their checks (``model.lora`` computes the adapters). No JAX here:
configs are validated before devices exist."""

from __future__ import annotations

from dataclasses import dataclass

from meshlm.errors import ConfigError
from meshlm.ranges import Range

ADAPTER = "lora_"  # an adapter module's name: "lora_" + its base weight's leaf name
NAMES = ("q", "k", "v", "o", "gate", "up", "down")  # the target names --lora-targets takes
RANGES = {
    "lora_rank": Range(int, 0, note="0: off"),
    "lora_alpha": Range(float, 0, note="0: the rank"),
    "lora_dropout": Range(float, 0, 1, high_open=True, note="0: off"),
}


@dataclass(frozen=True)
class LoraFields:
    """``ModelConfig``'s LoRA fields (a base, as ``MoEFields``): rank R (0: no adapters), alpha (0: R,
    a scale of 1), the comma-separated target names and the dropout probability of the adapters'
    input (0: off; the train step's alone, ``model.lora_dropout``). Absent from a saved config: no
    adapters."""

    lora_rank: int = 0
    lora_alpha: float = 0.0
    lora_targets: str = ""
    lora_dropout: float = 0.0

    @property
    def lora_scale(self) -> float:
        """alpha / R, the factor of the adapters' product (peft's ``scaling``)."""
        return (self.lora_alpha or self.lora_rank) / self.lora_rank

    @property
    def lora_paths(self) -> frozenset[str]:
        """The "module/param" suffixes of the targeted weights (e.g. "attn/wq"): the family's names."""
        if not self.lora_rank:
            return frozenset()
        return frozenset(targets(self)[t] for t in self.lora_targets.split(","))


def without_lora(cfg):
    """``cfg``'s model without adapters (every LoRA field at its default)."""
    return cfg.replace(lora_rank=0, lora_alpha=0.0, lora_targets="", lora_dropout=0.0)


def targets(cfg) -> dict[str, str]:
    """The target names ``cfg``'s model has -> their "module/param": its family's, of which a mixture
    of experts keeps the attention's (its MoE layers have no dense MLP) and multi-head latent attention
    none of the attention's (its projections are not ``lora.delta``'s: an adapter there was never
    created, and ``train --lora-rank`` trained nothing)."""
    have = dict(cfg.arch.lora_targets)
    if getattr(cfg, "mla", False):  # MLA's projections take no adapter (``model.mla``)
        have = {k: v for k, v in have.items() if not v.startswith("attn/")}
    return {k: v for k, v in have.items() if v.startswith("attn/")} if cfg.arch.moe else have


def check_lora(cfg) -> None:
    """The LoRA fields agree with each other and with the family, as one-line errors."""
    if not cfg.lora_rank:
        if cfg.lora_alpha or cfg.lora_targets or cfg.lora_dropout:
            raise ConfigError("--lora-alpha, --lora-targets and --lora-dropout need --lora-rank R (R >= 1)")
        return
    if not 0 <= cfg.lora_dropout < 1:
        raise ConfigError(f"--lora-dropout must be in [0, 1) (0: off), got {cfg.lora_dropout!r}")
    have = targets(cfg)
    if not have:
        why = " (multi-head latent attention takes no adapters yet)" if getattr(cfg, "mla", False) else ""
        raise ConfigError(f"--lora-rank: family {cfg.family!r} has no LoRA targets{why}; drop --lora-rank")
    names = cfg.lora_targets.split(",") if cfg.lora_targets else []
    unknown = [n for n in names if n not in have]
    if unknown or not names:
        raise ConfigError(
            f"--lora-targets {cfg.lora_targets!r}: unknown target(s) {unknown or '(none given)'} for "
            f"{cfg.family}; valid: {','.join(have)}"
        )
    _check_rank(cfg, names)
    _check_dropout(cfg)


def widths(cfg) -> dict[str, tuple[int, int]]:
    """Each target name's weight as a matrix (inputs, outputs), per the model config: its flattened
    dims (``model.lora.delta``: A [in, R], B [R, out])."""
    d, ff, e = cfg.d_model, cfg.d_ff, cfg.dim_per_head
    q, kv, heads_out = cfg.n_heads * e, cfg.kv_heads * e, cfg.n_heads * (cfg.v_head_dim or e)
    return {
        **{"q": (d, q * (1 + cfg.arch.attn_gate)), "k": (d, kv), "v": (d, kv), "o": (heads_out, d)},
        **{"gate": (d, ff), "up": (d, ff), "down": (ff, d)},
    }


def _check_rank(cfg, names: list[str]) -> None:
    """R at most the smallest width of the weights it adapts: a larger rank adds nothing a full-rank
    update lacks, and its adapters outgrow their weights (a large R: out of memory)."""
    have = widths(cfg)
    name = min(names, key=lambda n: min(have[n]))
    width = min(have[name])
    if cfg.lora_rank > width:
        rows, cols = have[name]
        raise ConfigError(
            f"--lora-rank {cfg.lora_rank} exceeds the smallest width of the weights it adapts: {name} "
            f"({targets(cfg)[name]}) is {rows} x {cols}; give --lora-rank R <= {width}"
        )


def _check_dropout(cfg) -> None:
    """Dropout's mask numbers each layer by its place in the one plain layer stack
    (``model.lora_dropout``): a mixture of experts' or a hybrid's stacks are refused."""
    from meshlm.model.layer_kinds import stacks

    if cfg.lora_dropout and (cfg.arch.moe or len(stacks(cfg)) > 1):
        raise ConfigError(
            f"--lora-dropout: {cfg.family}'s layers stack in more than one kind (a mixture of experts or "
            "a hybrid), whose layer numbering the dropout mask does not take yet; drop --lora-dropout"
        )
