"""What the memory planner plans: one training run's sizes and memory options (no JAX here, so the
CLI checks them before it sets up devices)."""

from __future__ import annotations

from dataclasses import dataclass

from meshlm.errors import ConfigError
from meshlm.model.config import ModelConfig, beyond_max_seq_len, default_seq_len
from meshlm.model.family import REMAT
from meshlm.model.quant_fields import QUANTS
from meshlm.parallel.layout import Layout
from meshlm.perf.plan_target import CHIP_NAMES, COMPILERS
from meshlm.ranges import POSITIVE_INT
from meshlm.settings import (
    SEQ_LEN_DEFAULT_TEXT,
    ExpertDispatch,
    LongContext,
    MeshFlags,
    Switch,
    setting,
)
from meshlm.train.config import OPT_DTYPE_NAMES
from meshlm.train.lora import LoraSettings, base_dtype
from meshlm.units import parse_bytes

DEFAULT_CONFIG = "llama2-7b"
DEFAULT_BATCH = 8  # rows per step where --batch-size is not given (raised to what the layout splits)


def remat_policy(cfg: ModelConfig) -> str:
    """The config's own remat as a policy name (it is a bool where only none/full exist)."""
    if isinstance(cfg.remat, bool):
        return "full" if cfg.remat else "none"
    return cfg.remat


@dataclass(frozen=True, kw_only=True)
class PlanSettings:
    batch_size: int  # global batch rows per optimizer step (split over dp, then into accum_steps)
    seq_len: int  # tokens per row
    accum_steps: int = 1  # micro-batches per optimizer step (gradient accumulation)
    compute_dtype: str = "float32"  # "float32" or "bfloat16" (bf16 compute, float32 master weights)
    fsdp: bool = False  # also shard weights and AdamW moments over dp (needs a step that supports it)
    sp: bool = False  # Megatron sequence parallelism over mp (needs a step that supports it)
    remat: str = "none"  # "none" | "full" | "selective" ("selective" needs a model that supports it)
    opt_dtype: str = "float32"  # AdamW's moments as stored: "float32" or "bf16" (``train.optim.OPT_DTYPES``)
    base_dtype: str = "float32"  # LoRA: the frozen base's stored dtype (``train.lora.base_dtype``)

    def micro_batch(self, dp: int) -> int:
        """Rows one device processes at once (its data shard of one micro-batch)."""
        return self.batch_size // (dp * self.accum_steps)

    def label(self) -> str:
        """Short name of the options: "fsdp+sp+remat=full+accum=2", or "plain"."""
        parts = [name for name in ("fsdp", "sp") if getattr(self, name)]
        parts += [f"remat={self.remat}"] if self.remat != "none" else []
        parts += [f"accum={self.accum_steps}"] if self.accum_steps > 1 else []
        parts += [f"opt={self.opt_dtype}"] if self.opt_dtype != "float32" else []
        return "+".join(parts) or "plain"

    def on(self, layout: Layout) -> Layout:
        """``layout`` (the mesh) with these settings' memory options."""
        return layout.replace(fsdp=self.fsdp, sp=self.sp)

    def check(self, cfg: ModelConfig, layout: Layout) -> None:
        """One-line errors for settings that cannot compile on ``layout``'s mesh, before any work."""
        layout = self.on(layout)
        if self.remat not in cfg.arch.remat:
            raise ConfigError(f"--remat {self.remat!r}; valid: {', '.join(cfg.arch.remat)}")
        if self.compute_dtype not in cfg.arch.compute_dtypes:
            raise ConfigError(
                f"compute_dtype={self.compute_dtype!r}; valid: {', '.join(cfg.arch.compute_dtypes)}"
            )
        from meshlm.sharding.rules import check_uniform_stack  # imports JAX: here

        check_uniform_stack(cfg, layout)
        if self.seq_len < 1:
            raise ConfigError(f"--seq-len {self.seq_len} must be >= 1")
        beyond_max_seq_len(cfg, self.seq_len)  # above max_seq_len: accepted for rotary models
        layout.check_batch(self.batch_size, self.accum_steps)
        layout.check_seq_len(self.seq_len)


@dataclass(frozen=True)
class PlanCommand(MeshFlags, LongContext, ExpertDispatch, LoraSettings):  # --pp, --lora-rank ...
    """What ``meshlm plan`` is asked: the model, one run's settings (``settings``) and the search; the
    command's flags are built from these fields (``meshlm.cli.common.add_flags``)."""

    config: str | None = setting(
        None, "model preset name (see `meshlm configs`)", shown_default=DEFAULT_CONFIG
    )
    checkpoint: str | None = setting(None, "plan the model of this checkpoint instead of --config")
    batch_size: int | None = setting(
        None,
        "global batch rows per step",
        shown_default=f"{DEFAULT_BATCH}, or the fewest rows above it that dp x accum x microbatches divide",
        valid=POSITIVE_INT,
    )
    seq_len: int | None = setting(
        None, "tokens per row", shown_default=SEQ_LEN_DEFAULT_TEXT, valid=POSITIVE_INT
    )
    accum_steps: int = setting(1, "micro-batches per optimizer step", valid=POSITIVE_INT)
    compute_dtype: str = setting(
        "float32",
        "float32, or bfloat16: bf16 compute with float32 master weights",
        switch=Switch("--bf16", "bfloat16", "bf16 compute with float32 master weights"),
    )
    remat: str | None = setting(None, "rematerialisation", shown_default="the config's own", choices=REMAT)
    opt_dtype: str = setting(
        "float32", "AdamW's moments as stored, as train --opt-dtype: float32 or bf16", choices=OPT_DTYPE_NAMES
    )
    quant: str | None = setting(
        None,
        "int8: plan the step with int8 weight matmuls (docs/quantization.md)",
        shown_default="the config's own",
        choices=QUANTS,
    )
    device_memory: int | None = setting(
        None,
        "memory of one device, e.g. 80GiB: say whether the run fits and search options that do",
        parse=parse_bytes,
    )
    chip: str | None = setting(
        None,
        "plan for this accelerator: compiled by its own compiler where it can (on the chip; anywhere "
        "with libtpu: pip install -e '.[tpu-plan]'), else by this host's with the chip's calibrated "
        "correction; its usable memory is --device-memory's default",
        choices=CHIP_NAMES,
    )
    compiler: str = setting(
        "auto",
        "with --chip: auto (the chip's compiler where it can, else the host's, corrected), chip (the "
        "chip's compiler, or an error), host (this host's compiler, corrected)",
        choices=COMPILERS,
    )
    max_compiles: int = setting(
        8, "most step compiles, the given settings and the candidates together", valid=POSITIVE_INT
    )
    every_option: bool = setting(
        False, "try each option alone, not only up to the cheapest that fits (more compiles)"
    )
    schedule_png: str | None = setting(None, "with --pp: draw the schedule (stage x tick) into this PNG")

    def device_bytes(self) -> int | None:
        """The memory a run must fit: --device-memory, else --chip's usable memory, else None."""
        if self.device_memory is not None or self.chip is None:
            return self.device_memory
        from meshlm.perf.plan_target import CHIPS

        return CHIPS[self.chip].usable_bytes

    def settings(self, cfg: ModelConfig, layout: Layout | None = None) -> PlanSettings:
        """The run to plan for the model ``cfg`` on ``layout``: its remat unless --remat, the default
        sequence rule; without --batch-size, 8 rows or the fewest above that the layout splits (a
        pipeline's micro-batches on every data shard: deepseek-v3 on 8x8 x pp 4, 32)."""
        batch = self.batch_size
        if batch is None:
            batch = layout.smallest_batch(DEFAULT_BATCH, self.accum_steps) if layout else DEFAULT_BATCH
        return PlanSettings(
            batch_size=batch,
            seq_len=default_seq_len(cfg, self.seq_len or 0),
            accum_steps=self.accum_steps,
            compute_dtype=self.compute_dtype,
            fsdp=self.fsdp,
            sp=self.sp,
            remat=self.remat or remat_policy(cfg),
            opt_dtype=self.opt_dtype,
            base_dtype=base_dtype(self),
        )
