"""What ``meshlm bench`` measures, as one settings dataclass: the library's ``run_bench`` reads it and
the command's flags are built from its fields (``meshlm.cli.common.add_flags``). No JAX here: the CLI
builds its parser from it before choosing devices.

Unlike ``TrainConfig`` it is not checked when built: ``check`` runs against the model and the mesh
(the batch must split over dp, the sequence fit the model), before anything is compiled.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from meshlm.errors import ConfigError
from meshlm.model.config import ModelConfig, beyond_max_seq_len, default_seq_len
from meshlm.model.family import COMPUTE_DTYPES, REMAT
from meshlm.model.quant_fields import QUANTS, check_quant
from meshlm.parallel.axes import AXIS, EP, PP
from meshlm.parallel.layout import Layout
from meshlm.ranges import NON_NEGATIVE_INT, POSITIVE_INT
from meshlm.settings import (
    CLI_COMMON,
    SEQ_LEN_DEFAULT_TEXT,
    ExpertDispatch,
    LongContext,
    MeshFlags,
    Switch,
    setting,
)
from meshlm.train.config import OPT_DTYPE_NAMES
from meshlm.train.lora import LoraSettings, check_lora_flags

MIN_STEPS = 5  # fewer timed steps give a median that is mostly noise on a shared machine
# Keeps a `small` bench near 1.5 minutes on 2 CPU cores (a step takes 1.7 s on an idle machine at
# seq 256, 4 s on a loaded one).
DEFAULT_BATCH = 4


# The implementations' names (``perf.bench``; here, without JAX, so that --impls is checked before the
# devices start). A mixture of experts has no ``plain`` (the hand-written model has no experts).
IMPLS = ("meshlm", "unsharded", "gspmd", "plain")
NO_PP = AXIS[PP].baseline  # "no-pp": the same model on the dp x mp mesh without the pipeline
NO_EP = AXIS[EP].baseline  # "no-ep": the same model on the same devices, every expert on every data shard
DENSE = "dense-eq"  # a MoE model: the dense model of equal active parameters (``bench_moe``)
TODAY = "dense-dispatch"  # the same MoE with the "dense" dispatch: every expert on every token
# the same MoE with each sorted dispatch, by name (``--impls`` only: built when named, so that one run
# times ragged_dot, gmm and dense-eq side by side; the default run times the command's dispatch alone)
SORTED_DISPATCHES = ("blocks", "ragged_dot", "gmm")
DISPATCH_IMPLS = {f"{d}-dispatch": d for d in SORTED_DISPATCHES}
INT8 = "meshlm-int8"  # --quant int8: meshlm's step with int8 weight matmuls (``model.quant``), beside meshlm


def impl_names(cfg: ModelConfig, layout: Layout) -> tuple[str, ...]:
    """Every implementation the bench has for this model and mesh, in the order it builds and reports
    them (``--impls`` picks some of these)."""
    if cfg.lora_rank:  # the others are full fine-tunes (``plain`` has no adapters): no yardstick here
        return IMPLS[:1]
    names = [*IMPLS[:3], *(() if cfg.arch.moe else ("plain",)), *layout.baselines()]
    if cfg.arch.moe:  # the dense model of equal active parameters; today's dispatch beside it
        names += [DENSE, *((TODAY,) if cfg.moe_dispatch != "dense" else ()), *DISPATCH_IMPLS]
    return tuple(names)


def parse_batches(text: str) -> str:
    """--gen-batch's text as the comma list of positive ints it names, spaces dropped."""
    names = [n.strip() for n in text.split(",")]
    if not all(n.isdigit() and int(n) > 0 for n in names):
        raise ValueError(f"{text!r}: give a comma list of positive batch sizes such as 1,8,32,64")
    return ",".join(names)


def parse_impls(text: str) -> str:
    """--impls' text as the comma list it names, spaces dropped; which names the model has is checked
    against it later (``BenchSettings.check``: they depend on the model and the mesh)."""
    names = [n.strip() for n in text.split(",")]
    if not all(names):
        raise ValueError(f"{text!r} has an empty name; give a comma list such as meshlm,plain")
    return ",".join(names)


@dataclass(frozen=True)
class BenchComparisons:
    """bench's side-by-side modes: each times its comparison instead of the implementations."""

    compare_schedules: bool = setting(
        False,
        "with --pp: time every schedule (gpipe, 1f1b with and without --remat full, interleaved V=2) side "
        "by side against no-pp, each overhead next to its ideal bubble, instead of the implementations",
    )
    compare_window: int = setting(
        0,
        "with --attention blockwise: time the step with a sliding window of this many positions side by "
        "side against full attention, with the K/V block pairs each computes, instead of the implementations",
        valid=NON_NEGATIVE_INT,
    )
    compare_linear: bool = setting(
        False,
        "with a hybrid and --attention blockwise: time its linear-attention layer against its full-attention "
        "layer (forward and backward) at --seq-len / 16, / 4 and --seq-len, in tokens/s, instead of the "
        "implementations",
    )


# --moe-dispatch (``ExpertDispatch``): "dense" is also timed beside the others, as dense-dispatch
# --lora-rank (``LoraSettings``): a LoRA step on a random frozen base (no checkpoint: the speed and memory
# of the step do not depend on the base's values), meshlm's implementation alone
@dataclass(frozen=True)
class BenchSettings(MeshFlags, LongContext, ExpertDispatch, LoraSettings, BenchComparisons):  # --pp, --cp ...
    config: str = setting("small", "model preset (see `meshlm configs`)", cli=CLI_COMMON)
    batch_size: int | None = setting(
        None,
        "global batch rows, split over dp",
        shown_default=f"{DEFAULT_BATCH}, rounded up to a multiple of dp",
        valid=POSITIVE_INT,
    )
    seq_len: int | None = setting(
        None, "tokens per row", shown_default=SEQ_LEN_DEFAULT_TEXT, valid=POSITIVE_INT
    )
    steps: int = setting(MIN_STEPS, f"timed steps per implementation (>= {MIN_STEPS})", valid=POSITIVE_INT)
    warmup: int = setting(1, "untimed steps per implementation first", valid=NON_NEGATIVE_INT)
    seed: int = setting(0, "random seed", cli=CLI_COMMON, valid=NON_NEGATIVE_INT)
    gen_new_tokens: int = setting(
        16,
        "new tokens per row in the generation bench (0: skip)",
        valid=NON_NEGATIVE_INT,
        flag="--gen-tokens",
    )
    gen_batch: str | None = setting(
        None,
        "comma list of batch sizes for the generation bench, e.g. 1,8,32,64: each one's prefill and "
        "decode tokens/s and memory roofline (where batching stops paying)",
        shown_default="--batch-size",
        parse=parse_batches,
    )
    peak_n: int = setting(
        2048, "matmul size of the peak measurement (raise on accelerators)", valid=POSITIVE_INT
    )
    impls: str | None = setting(
        None,
        "comma list of the implementations to build and time, e.g. meshlm,plain: only those are held in "
        "memory (a model that fills the device fits once, not once per implementation)",
        shown_default="every one the model has",
        parse=parse_impls,
    )
    quant: str = setting(
        "none",
        f"int8: also time meshlm's step with int8 weight matmuls (docs/quantization.md) as {INT8}, beside "
        f"the float one (--impls meshlm,{INT8}: the two side by side)",
        choices=QUANTS,
    )
    compute_dtype: str = setting(
        "float32",
        "float32, or bfloat16: bf16 compute with float32 master weights",
        switch=Switch("--bf16", "bfloat16", "bf16 compute with float32 master weights, as train --bf16"),
        choices=COMPUTE_DTYPES,
    )
    opt_dtype: str = setting(
        "float32",
        "AdamW's moments as stored, as train --opt-dtype: float32, or bf16 (both in bfloat16)",
        choices=OPT_DTYPE_NAMES,
    )
    remat: str = setting(
        "none",
        "per-layer recomputation in the backward, as train --remat: none, full, selective (keep matmul "
        "outputs), save_qkv_proj, save_qkv_mlp_in or save_qkv_attn (keep those projections; the last also "
        "the attention's output); cuts activation memory "
        "(the plain row has none: it is the hand-written model)",
        choices=REMAT,
    )
    unroll: int = setting(
        0,
        "layers per iteration of the layer loop (0: all, the default, but 1 under --remat, whose saving "
        "needs the loop; 1: a rolled loop)",
        valid=NON_NEGATIVE_INT,
    )
    vocab_size: int | None = setting(
        None,
        "token ids of the model instead of the preset's (e.g. the main job's 1024-id BPE)",
        valid=POSITIVE_INT,
    )
    out: str | None = setting(None, "also write bench.json and bench.png into this directory")
    memory_options: bool = setting(
        False, "also time FSDP and sequence parallelism against tensor parallelism and GSPMD"
    )

    def resolved(self, cfg: ModelConfig, layout: Layout) -> BenchSettings:
        """The sizes left open filled in: the batch rounded up to a multiple of dp, the sequence by
        every command's rule (``default_seq_len``)."""
        rows = layout.dp * layout.pipeline_microbatches
        batch = self.batch_size or -(-DEFAULT_BATCH // rows) * rows
        return dataclasses.replace(self, batch_size=batch, seq_len=default_seq_len(cfg, self.seq_len or 0))

    def check(self, cfg: ModelConfig, layout: Layout) -> None:
        s = self.resolved(cfg, layout)
        check_impls(s, cfg, layout)
        if s.steps < MIN_STEPS:
            raise ConfigError(f"--steps must be >= {MIN_STEPS} (a median of fewer is noise), got {s.steps}")
        if s.warmup < 0:
            raise ConfigError(f"--warmup must be >= 0, got {s.warmup}")
        if s.batch_size < 1:
            raise ConfigError(f"--batch-size must be >= 1, got {s.batch_size}")
        layout.check_batch(s.batch_size)
        from meshlm.sharding.rules import check_uniform_stack  # imports JAX: here

        check_uniform_stack(cfg, layout)
        if s.compare_schedules and layout.pipeline is None:
            raise ConfigError("--compare-schedules times pipeline schedules; add --pp 2 (or more)")
        if s.memory_options and layout.pipeline is not None:
            raise ConfigError("--memory-options times fsdp and sp against tp; run it without --pp")
        layout.check_seq_len(s.seq_len)
        if s.seq_len < 1:
            raise ConfigError(f"--seq-len {s.seq_len} must be >= 1")
        beyond_max_seq_len(cfg, s.seq_len)  # above max_seq_len: accepted for rotary models
        if not (s.compare_window or s.compare_linear or s.compare_schedules):
            _check_timed_shape(s, cfg)
        if s.gen_new_tokens < 0:
            raise ConfigError(
                f"--gen-tokens must be >= 0 (0 skips the generation bench), got {s.gen_new_tokens}"
            )
        if s.peak_n < min_peak_n(cfg):
            raise ConfigError(
                f"--peak-n {s.peak_n} is too small to measure a peak: a matmul narrower than the model's "
                f"own (d_model={cfg.d_model}) runs below the rate the model's matmuls reach, so MFU over it "
                f"overstates (--peak-n 1 gave MFU 20,730); use --peak-n {min_peak_n(cfg)} or more (2048, "
                "the default, on a CPU; 8192 on an accelerator)"
            )


def min_peak_n(cfg: ModelConfig) -> int:
    """The smallest peak matmul (n x n @ n x n) whose rate bounds the model's: its projections contract
    over d_model, [tokens, d_model] @ [d_model, ...], so a square matmul narrower than d_model is less
    efficient than the model's own and its "peak" is below what the model reaches."""
    return cfg.d_model


def _check_timed_shape(s: BenchSettings, cfg: ModelConfig) -> None:
    """Refused, never run or silently cut: a sequence above the model's max_seq_len with plain
    attention (4096 on a 64-token preset: every implementation's [T, T] scores at 4096x the preset's,
    hours on a CPU; a long-context bench above max_seq_len uses --attention blockwise or flash, as
    docs/benchmarks.md's), and generation beyond the context."""
    if s.seq_len > cfg.max_seq_len and cfg.attention == "plain":
        raise ConfigError(
            f"--seq-len {s.seq_len} is above the model's max_seq_len={cfg.max_seq_len} with plain "
            f"attention (its [T, T] scores in every implementation's step); use --seq-len "
            f"{cfg.max_seq_len} or less, or --attention blockwise for a long-context bench"
        )
    room = cfg.max_seq_len // 2  # the generation bench's prompt takes the other half (or --seq-len)
    if s.gen_new_tokens > room:
        raise ConfigError(
            f"--gen-tokens {s.gen_new_tokens} does not fit the model's context of {cfg.max_seq_len} "
            f"tokens with a prompt (generate refuses it too); use --gen-tokens {room} or less (half the "
            "context: the prompt gets the rest), or 0 to skip the generation bench"
        )


# --impls, --gen-batch and the accelerator flags (module functions: the settings class stays a record)
def gen_batches(self: BenchSettings) -> tuple[int, ...]:
    """The generation bench's batch sizes: --gen-batch's, or --batch-size (resolved first)."""
    return tuple(map(int, self.gen_batch.split(","))) if self.gen_batch else (self.batch_size,)


def chosen(self: BenchSettings, available: tuple[str, ...]) -> tuple[str, ...]:
    """The implementations to build, in the bench's order: --impls' of ``available`` (every one
    the model and mesh have), or all of them but the sorted dispatches' (``DISPATCH_IMPLS``: named only)."""
    if self.quant == "int8":  # beside meshlm's own float step
        available = (*available[:1], INT8, *available[1:])
    if self.impls is None:
        return tuple(n for n in available if n not in DISPATCH_IMPLS)
    asked = self.impls.split(",")
    if unknown := [n for n in asked if n not in available]:
        raise ConfigError(
            f"--impls {self.impls}: no implementation {', '.join(unknown)} for this model and mesh; "
            f"valid: {','.join(available)}"
        )
    return tuple(n for n in available if n in asked)


def check_impls(self: BenchSettings, cfg: ModelConfig, layout: Layout) -> None:
    """--impls names implementations this model and mesh have, --bf16 a dtype the family trains in,
    and neither is given to a --compare-* or --memory-options run, which build steps of their own."""
    check_lora_flags(self)  # --lora-alpha or --base-dtype without --lora-rank: one line
    chosen(self, impl_names(cfg, layout))
    if self.quant != "none":  # what --quant int8 covers, before any work
        check_quant(cfg.replace(quant=self.quant), layout)
    if self.compute_dtype not in cfg.arch.compute_dtypes:
        raise ConfigError(
            f"--bf16: {cfg.arch.name} trains in {', '.join(cfg.arch.compute_dtypes)} only; drop --bf16"
        )
    if self.remat not in cfg.arch.remat:
        raise ConfigError(f"--remat {self.remat}: {cfg.arch.name} supports {', '.join(cfg.arch.remat)}")
    own = [
        f
        for f in ("compare_schedules", "compare_window", "compare_linear", "memory_options")
        if getattr(self, f)
    ]
    given = [f for f, v in (("--impls", self.impls), ("--bf16", self.compute_dtype != "float32")) if v]
    if own and self.lora_rank:
        raise ConfigError(f"--{own[0].replace('_', '-')} times full fine-tunes' steps; drop --lora-rank")
    if own and given:
        raise ConfigError(
            f"--{own[0].replace('_', '-')} times steps of its own, in float32; drop {' and '.join(given)}"
        )
