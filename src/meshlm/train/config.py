"""The training configuration: one frozen dataclass whose fields describe themselves.

Each field's metadata (built by ``_field``) holds its help text, whether a resumed run must use the same
value, and how ``meshlm train`` exposes it. The command's flags, its ``TrainConfig`` construction and the
resume check are all derived from it, so a new field is declared in one place.

This module must not import JAX: the CLI builds its parser from it before choosing devices.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

from meshlm.errors import ConfigError
from meshlm.model.config import PRESETS, ModelConfig, beyond_max_seq_len, default_seq_len, get_config
from meshlm.model.family import COMPUTE_DTYPES, REMAT
from meshlm.model.quant_fields import QuantSettings
from meshlm.ranges import (
    MAX_SEQ_LEN,
    NON_NEGATIVE_FLOAT,
    NON_NEGATIVE_INT,
    POSITIVE_FLOAT,
    POSITIVE_INT,
    Range,
)
from meshlm.settings import (  # noqa: F401 - CLI_* and Switch: the train CLI reads them from here
    CLI_COMMON,
    CLI_FLAG,
    CLI_HIDDEN,
    SEQ_LEN_DEFAULT_TEXT,
    ExpertDispatch,
    LongContext,
    MeshFlags,
    Switch,
    check_fields,
    setting,
)
from meshlm.train.dpo_settings import ObjectiveSettings
from meshlm.train.lora import LoraSettings, check_lora_flags

# `meshlm train` without --mesh: DEFAULT_DP x (devices / DEFAULT_DP), 2x2 on the default 4 fake devices,
# the fastest data x model mesh on a 2-core CPU (docs/training.md, "Choosing the main job's defaults").
DEFAULT_DP = 2

# The tokenizer of a run from scratch on the embedded stdlib corpus (the main job): a 1024-id byte-level BPE
# trained on its training split reaches a lower val_bpb in the same time than bytes (docs/training.md).
MAIN_JOB_TOKENIZER = "bpe-1024"

# --opt-dtype's names (``train.optim.OPT_DTYPES``: this module must not import JAX)
OPT_DTYPE_NAMES = ("float32", "bf16")

# The model of a run without --config: this preset, or with --checkpoint the checkpoint's own model.
DEFAULT_PRESET = "cpu"

_field = setting  # a field that describes itself (``meshlm.settings``)


@dataclass(frozen=True)
class MoESettings:
    """``TrainConfig``'s mixture-of-experts settings and multi-token prediction's weight (a base, as
    ``MeshFlags``): None is the model's own value (``with_moe_settings`` applies them to the model
    config, which the checkpoint records)."""

    moe_aux_loss: str | None = _field(
        None,
        "a mixture of experts' load-balancing convention: hf (transformers': pooled over layers, ~k "
        "balanced) or per-layer (Megatron's: the mean over layers, ~1); its coefficient is the model's "
        "router_aux_loss_coef (an imported config's)",
        resume_must_match=True,
        shown_default="the model's",
        choices=("hf", "per-layer"),
    )
    moe_capacity_factor: float | None = _field(
        None,
        "a mixture of experts' capacity factor C: each expert takes at most ceil(C x tokens x k / E) "
        "token-choices of a step's global batch (a micro-batch's under --accum-steps), the rest dropped "
        "by GShard's rule; 0: dropless; C >= E / k keeps every choice (any larger C is the same)",
        resume_must_match=True,
        shown_default="the model's (0: dropless)",
        valid=NON_NEGATIVE_FLOAT,
    )
    moe_bias_rate: float | None = _field(
        None,
        "a mixture of experts' aux-loss-free balancing rate: after each step every expert's selection "
        "bias moves by rate x sign(mean load - its load) over the step's global batch (a model with "
        "balance_bias: sigmoid routers, DeepSeek-V3's); 0: the bias stays",
        resume_must_match=True,
        shown_default="the model's",
        valid=NON_NEGATIVE_FLOAT,
    )
    mtp_weight: float | None = _field(
        None,
        "multi-token prediction's weight lambda (DeepSeek-V3): loss = main + lambda / D x the D depths' "
        "losses; 0: the MTP layers are kept but not trained; a model without MTP layers refuses it",
        resume_must_match=True,
        shown_default="the model's (tiny-deepseek-v3: 0.3)",
        valid=NON_NEGATIVE_FLOAT,
    )


@dataclass(frozen=True)
class DtypeSettings:
    """``TrainConfig``'s dtypes (a base, as ``MoESettings``): the step's compute and AdamW's moments."""

    compute_dtype: str = _field(
        "float32",
        "float32, or bfloat16: bf16 compute with float32 master weights",
        resume_must_match=True,
        switch=Switch("--bf16", "bfloat16", "bf16 compute with float32 master weights"),
        choices=COMPUTE_DTYPES,
    )
    opt_dtype: str = _field(
        "float32",
        "AdamW's moments as stored: float32, or bf16 (both moments in bfloat16, the update computed in "
        "float32 from them: 4 bytes a parameter less)",
        resume_must_match=True,
        choices=OPT_DTYPE_NAMES,
    )


METRICS = "metrics.jsonl"  # a run's metrics, one JSON object a line (``train.metrics``)


def check_compare(compare: str, out: str) -> None:
    """train's --compare before any work: another run's directory, holding a metrics.jsonl."""
    if not compare:
        return
    if os.path.realpath(compare) == os.path.realpath(out):
        raise ConfigError(f"--compare {compare} is this run's --out; name another run's directory")
    if not os.path.isfile(os.path.join(compare, METRICS)):
        raise ConfigError(
            f"--compare {compare}: no {METRICS} there; name the --out of an earlier `meshlm train` run"
        )


@dataclass(frozen=True)
class CurveSettings:
    """train's --compare (a base of ``TrainConfig``, as ``DtypeSettings``): what loss_curve.png draws."""

    compare: str = _field(
        "",
        "an earlier run directory whose curves (its metrics.jsonl, read only) loss_curve.png draws beside "
        "this run's, e.g. the float run beside --quant int8's",
    )


@dataclass(frozen=True)
class TrainConfig(
    MeshFlags,
    LongContext,
    ExpertDispatch,
    MoESettings,
    DtypeSettings,
    ObjectiveSettings,
    LoraSettings,
    QuantSettings,
    CurveSettings,
):  # --pp, --lora-rank...
    # "": the cpu preset, or with --checkpoint the checkpoint's own model (its CLI help: cli/train.py)
    config: str = _field("", "model preset (see `meshlm configs`)", resume_must_match=True, cli=CLI_COMMON)
    data: tuple[str, ...] = _field(
        (),
        "text, JSONL(.gz/.zst), Parquet files, directories (or saved datasets), globs, or a token store",
        resume_must_match=True,
        shown_default="the Python stdlib's .py files",
    )
    text_field: str = _field("text", "text field of JSONL / Parquet / dataset rows", resume_must_match=True)
    doc_mask: bool = _field(False, "attention within documents, positions restart", resume_must_match=True)
    # Defaults of steps, batch_size, lr, warmup_steps (mesh: DEFAULT_DP): scripts/sweep_main.py's sweep.
    steps: int = _field(280, "optimizer steps; the defaults take ~5 min on a 2-core CPU", valid=POSITIVE_INT)
    batch_size: int = _field(
        32,
        "global sequences per step, split over dp and micro-batches",
        resume_must_match=True,
        valid=POSITIVE_INT,
    )
    seq_len: int = _field(
        0,
        "tokens (bytes) per sequence",
        resume_must_match=True,
        shown_default=SEQ_LEN_DEFAULT_TEXT,
        valid=Range(int, 0, MAX_SEQ_LEN, note="0: the preset's default; no model has a longer context"),
    )
    lr: float = _field(
        3e-3, "peak lr: warm-up, cosine to lr * --min-lr-ratio", resume_must_match=True, valid=POSITIVE_FLOAT
    )
    warmup_steps: int = _field(20, "linear warm-up steps", resume_must_match=True, valid=NON_NEGATIVE_INT)
    min_lr_ratio: float = _field(
        0.1, "the cosine's last lr over --lr", resume_must_match=True, valid=Range(float, 0, 1)
    )
    weight_decay: float = _field(
        0.1, "AdamW decay on weight matrices only", resume_must_match=True, valid=NON_NEGATIVE_FLOAT
    )
    clip_norm: float = _field(
        1.0,
        "global gradient-norm clip; 0 disables",
        resume_must_match=True,
        valid=Range(float, 0, note="0 disables"),
    )
    accum_steps: int = _field(
        1, "micro-batches per step, for gradient accumulation", resume_must_match=True, valid=POSITIVE_INT
    )
    eval_every: int = _field(
        140,
        "steps between validation evaluations; 0: only at the end",
        valid=Range(int, 0, note="0: only at the end"),
    )
    eval_batches: int = _field(8, "validation batches per evaluation", valid=POSITIVE_INT)
    save_every: int = _field(
        280, "steps between checkpoints; 0: only at the end", valid=Range(int, 0, note="0: only at the end")
    )
    keep: int = _field(3, "checkpoints to keep", valid=POSITIVE_INT)
    log_every: int = _field(1, "steps between metrics.jsonl train rows", valid=POSITIVE_INT)
    seed: int = _field(
        0, "parameter init and data order", resume_must_match=True, cli=CLI_COMMON, valid=NON_NEGATIVE_INT
    )
    out: str = _field(
        "runs/main",
        "run directory: checkpoints, metrics.jsonl, TensorBoard, loss curve; resumes if it has checkpoints",
    )
    fresh: bool = _field(False, "start over; refuses if --out holds checkpoints or other run outputs")
    checkpoint: str = _field("", "initial parameters from a checkpoint (e.g. converted HF)")
    sample_tokens: int = _field(
        200, "tokens generated at the end as a sample; 0: none", valid=Range(int, 0, note="0: none")
    )
    remat: str = _field(
        "none",
        "per-layer recomputation in the backward: none, full (keep each layer's input), selective (keep the "
        "matmul outputs), save_qkv_proj (keep q/k/v), save_qkv_mlp_in (keep q/k/v and the MLP's gate/up), "
        "save_qkv_attn (keep q/k/v and the attention's output: no attention recomputed)",
        choices=REMAT,
    )
    tokenizer: str = _field(
        "",
        "a tokenizer.json (see `meshlm tokenizer train`), 'bytes', or bpe-N: train an N-id byte-level "
        "BPE into --out first; from scratch it sets the model's vocab_size",
        shown_default=f"the run's or checkpoint's; new: {MAIN_JOB_TOKENIZER} on stdlib code, else bytes",
    )
    unroll: int = _field(
        0,
        "layers per iteration of the layer loop; 0: all (faster on CPU), but 1 under --fsdp or --remat "
        "(their memory saving needs the loop); changes speed and memory, never results",
        valid=Range(int, 0, note="0: auto"),
    )

    def __post_init__(self):
        _validate(self)  # library users never pass argparse's checks: enforced here too, before any work

    @property
    def micro_batch(self) -> int:
        return self.batch_size // self.accum_steps

    def optim(self):
        """The optax-side settings (imported lazily: this module must not import JAX)."""
        from meshlm.train.optim import OptimConfig

        keep = ("lr", "warmup_steps", "min_lr_ratio", "weight_decay", "clip_norm", "accum_steps", "opt_dtype")
        return OptimConfig(total_steps=self.steps, **{name: getattr(self, name) for name in keep})

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["data"] = list(self.data)
        return d


def _validate(tcfg: TrainConfig) -> None:
    """Every field's range and choices, and the batch split: one-line errors naming the flag."""
    check_fields(tcfg)
    check_lora_flags(tcfg)
    _check_out_is_not_the_checkpoint(tcfg)
    if tcfg.batch_size % tcfg.accum_steps:
        fit = (tcfg.batch_size // tcfg.accum_steps + 1) * tcfg.accum_steps
        raise ConfigError(
            f"batch_size={tcfg.batch_size} is not divisible by accum_steps={tcfg.accum_steps}; "
            f"use e.g. --batch-size {fit}"
        )


def _check_out_is_not_the_checkpoint(tcfg: TrainConfig) -> None:
    """--out the --checkpoint (or a directory holding it): the run would resume the checkpoint's own
    run instead of starting from its parameters, and its rotation could delete the checkpoint."""
    if not tcfg.checkpoint:
        return
    out, ck = (os.path.realpath(p) for p in (tcfg.out, tcfg.checkpoint))
    if ck == out or ck.startswith(out.rstrip(os.sep) + os.sep):
        where = "is the --checkpoint" if ck == out else f"holds the --checkpoint {tcfg.checkpoint}"
        raise ConfigError(
            f"--out {tcfg.out} {where}: a run writes its own checkpoints into --out; to continue that run "
            f"drop --checkpoint (meshlm train --out {tcfg.out} resumes it), to fine-tune from it pass "
            "another --out"
        )


# Not in a run's settings.toml: what its first start did, not what the run is (a resume would refuse).
NOT_RECORDED = ("fresh",)


def recorded_settings(tcfg: TrainConfig, mesh: str, devices: int | None) -> dict:
    """What a run writes to its settings.toml (``meshlm.settings.toml_text``): its resolved fields under
    their flags' names, with its ``--mesh`` (DPxMP) and ``--devices`` (None: left out), so that
    ``meshlm train --settings FILE`` runs it again."""
    fields = {k: v for k, v in tcfg.to_dict().items() if k not in NOT_RECORDED}
    # --out absolute: the file names its own run from any directory (relative, `train --settings` run
    # elsewhere started a new run there); not compared on resume, so an older run's file still resumes
    fields["out"] = os.path.abspath(tcfg.out)
    return {"mesh": mesh, "devices": devices, **fields}


def resume_must_match() -> tuple[str, ...]:
    """The fields that change the computation: a resumed run must use the values it was saved with."""
    return tuple(f.name for f in dataclasses.fields(TrainConfig) if f.metadata["resume_must_match"])


def with_moe_settings(tcfg: TrainConfig, cfg: ModelConfig) -> ModelConfig:
    """``cfg`` with the run's --moe-aux-loss and --moe-capacity-factor (None: the model's own); a
    dense model refuses them (``ModelConfig``: MoE fields). Recorded in the checkpoint's model config."""
    if tcfg.moe_aux_loss is not None:
        cfg = cfg.replace(moe_aux_loss=tcfg.moe_aux_loss)
    if tcfg.moe_capacity_factor is not None:
        cfg = cfg.replace(moe_capacity_factor=tcfg.moe_capacity_factor)
    if tcfg.moe_bias_rate is not None:  # a model without the selection bias refuses it (RouterFields)
        cfg = cfg.replace(moe_bias_rate=tcfg.moe_bias_rate)
    if tcfg.mtp_weight is not None:  # a model without MTP layers refuses a weight (``MTPFields``)
        cfg = cfg.replace(mtp_weight=tcfg.mtp_weight)
    return cfg


def resolve(tcfg: TrainConfig, model: ModelConfig | None = None) -> tuple[TrainConfig, ModelConfig]:
    """``tcfg`` with its preset-dependent defaults filled in, and its ModelConfig: ``model`` (a
    ``--checkpoint``'s own, read by ``train.run``), else ``--config``'s preset (``DEFAULT_PRESET``
    without one).

    The one place ``seq_len=0`` becomes a length: the run, its checkpoint meta and the resume check
    all see the resolved value, so a default run resumes under an explicit ``--seq-len`` and back.
    """
    if model is None and not tcfg.config:
        tcfg = dataclasses.replace(tcfg, config=DEFAULT_PRESET)  # what runs before --checkpoint recorded
    cfg = model or get_config(tcfg.config)
    seq_len = default_seq_len(cfg, tcfg.seq_len)
    name = tcfg.config if model is None else f"--checkpoint {tcfg.checkpoint}"
    if note := beyond_max_seq_len(cfg, seq_len, name):  # rotary: a limit of the config, not a table
        _print_once(note)
    return dataclasses.replace(tcfg, seq_len=seq_len), cfg


@functools.cache
def _print_once(note: str) -> None:
    """A note on stderr once per process (``resolve`` runs in the CLI and again in ``build_run``)."""
    import sys

    print(note, file=sys.stderr)


def from_scratch_tokenizer(tcfg: TrainConfig) -> str:
    """The tokenizer a run asks for when neither its run directory nor --checkpoint has one: --tokenizer,
    else on the embedded corpus ``MAIN_JOB_TOKENIZER``, else "" (bytes)."""
    if tcfg.tokenizer:
        return tcfg.tokenizer
    return "" if tcfg.data or tcfg.checkpoint else MAIN_JOB_TOKENIZER


def check_byte_vocab(tcfg: TrainConfig, cfg: ModelConfig) -> None:
    """Training data is bytes: a smaller vocabulary would only fail once the data is loaded and
    checked, so refuse it from the config alone."""
    from meshlm.data.tokenizer import VOCAB_SIZE  # lazy: building the parser needs none of its imports

    if cfg.vocab_size < VOCAB_SIZE and from_scratch_tokenizer(tcfg) in ("", "bytes"):
        fits = ", ".join(name for name, c in PRESETS.items() if c.vocab_size == VOCAB_SIZE)
        raise ConfigError(
            f"the {tcfg.config} preset has vocab_size={cfg.vocab_size}, but the training data is bytes "
            f"(needs {VOCAB_SIZE}); use a byte-vocabulary preset ({fits})"
        )
