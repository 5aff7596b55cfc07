"""What ``meshlm verify`` proves, as one settings dataclass: its flags are built from the fields
(``meshlm.cli.common.add_flags``), as ``meshlm train``'s are from ``TrainConfig``."""

from __future__ import annotations

from dataclasses import dataclass

from meshlm.model.family import REMAT
from meshlm.model.quant_fields import QUANTS
from meshlm.ranges import NON_NEGATIVE_FLOAT, NON_NEGATIVE_INT, POSITIVE_INT, Range
from meshlm.settings import (
    CLI_COMMON,
    SEQ_LEN_DEFAULT_TEXT,
    ExpertDispatch,
    LongContext,
    MeshFlags,
    Switch,
    check_fields,
    setting,
)
from meshlm.train.config import OPT_DTYPE_NAMES
from meshlm.train.lora import LoraSettings, check_lora_flags

# One token attends only to itself: the causal mask and attention across positions would go unproven
# (and 0 tokens give a NaN loss, reported as a FAIL).
MIN_SEQ_LEN = 2

# Each proof step runs sharded and unsharded and compares every leaf: 10,000 is hours; more is a typo.
MAX_PROOF_STEPS = Range(int, 0, 10_000)


# --moe-dispatch (``ExpertDispatch``): the sharded run's; the reference runs "dense" (``proof.problem``)
@dataclass(frozen=True)
class VerifySettings(MeshFlags, LongContext, ExpertDispatch, LoraSettings):  # --pp, --cp, --lora-rank ...
    config: str = setting("seed", "model preset (see `meshlm configs`)", cli=CLI_COMMON)
    seed: int = setting(0, "random seed", cli=CLI_COMMON, valid=NON_NEGATIVE_INT)
    steps: int = setting(
        0, "also compare K full training steps (each runs sharded and not; <= 10000)", valid=MAX_PROOF_STEPS
    )
    x64: bool = setting(False, "float64: worst relative error must be <= 1e-12")
    opt_dtype: str = setting(
        "float32",
        "the training steps' AdamW moments as stored, as train --opt-dtype: float32 (the parameters' "
        "dtype: float64 under --x64), or bf16 (bfloat16 under --x64 too)",
        choices=OPT_DTYPE_NAMES,
    )
    batch_size: int | None = setting(
        None,
        "global batch, a multiple of dp",
        shown_default="one row per data shard (per micro-batch)",
        valid=POSITIVE_INT,
    )
    seq_len: int | None = setting(
        None,
        f"sequence length (>= {MIN_SEQ_LEN}; at most the model's max_seq_len)",
        shown_default=SEQ_LEN_DEFAULT_TEXT,
        valid=Range(int, MIN_SEQ_LEN),
    )
    checkpoint: str | None = setting(None, "prove with these parameters (run dir or step dir)")
    z_loss: float | None = setting(None, "prove with this z-loss coefficient", valid=NON_NEGATIVE_FLOAT)
    quant: str | None = setting(
        None,
        "prove the int8 weight matmuls (docs/quantization.md): the sharded int8 step against the unsharded "
        "int8 step, bit for bit where the integer sums make it exact",
        shown_default="the config's (none)",
        choices=QUANTS,
    )
    moe_aux_loss: str | None = setting(
        None,
        "a mixture of experts' load-balancing convention: hf (pooled over layers, ~k balanced) or "
        "per-layer (Megatron's, ~1)",
        shown_default="the config's",
        choices=("hf", "per-layer"),
    )
    moe_capacity_factor: float | None = setting(
        None,
        "a mixture of experts' capacity factor C: each expert takes at most ceil(C x tokens x k / E) "
        "token-choices of the global batch, the rest dropped (GShard's rule); 0: dropless; C >= E / k keeps "
        "every choice (any larger C is the same)",
        shown_default="the config's",
        valid=NON_NEGATIVE_FLOAT,
    )
    allow_routing_flips: bool = setting(
        False,
        "float32, a mixture of experts: pass the routing-flips row when tokens near a top-k tie route "
        "differently in the two runs (still counted and printed; the tolerance unchanged; float64 refuses)",
    )
    collectives: bool = setting(
        True,
        "the communication check",
        switch=Switch(
            "--no-collectives",
            False,
            "skip the communication check (compiling the train step and counting its collectives)",
        ),
    )
    doc_mask: bool = setting(
        False,
        "prove document masking on EOD-rich batches (EOD: a checkpoint's tokenizer's, else the byte "
        "tokenizer's 0), with its controls",
    )
    objective: str = setting(
        "lm",
        "the loss to prove: lm (every target), sft (a chat loss mask of unequal counts per row, shard "
        "and micro-batch: sum(mask x loss) / sum(mask) over the global batch) or dpo (DPO's pair sums, "
        "loss and gradients against a frozen reference), with its controls",
        choices=("lm", "sft", "dpo"),
    )
    dpo_loss: str = setting("sigmoid", "with --objective dpo: the loss to prove", choices=("sigmoid", "ipo"))
    remat: str | None = setting(
        None, "prove with this recomputation policy", shown_default="the config's", choices=REMAT
    )
    # verify's defaults expose bugs that convenient shapes hide (``meshlm.proof.defaults``)
    microbatches: int | None = setting(
        None, "with --pp: micro-batches per step", shown_default="2 x pp", valid=POSITIVE_INT
    )
    virtual_stages: int | None = setting(
        None,
        "with --pp-schedule interleaved: layer chunks per device (V)",
        shown_default="the smallest V >= 2 other than pp that splits the layers",
        valid=POSITIVE_INT,
    )
    attn_block: int | None = setting(
        None,
        "queries and keys per block (blockwise attention, and each --cp ring step)",
        shown_default="several blocks per shard, the last of one row",
        valid=Range(int, 1),
    )
    matrix: bool = setting(False, "prove every preset x mesh x option that fits")
    md: bool = setting(False, "with --matrix: print the table as markdown")
    axes: str = setting(
        "",
        "with --matrix: also the cells of these axes (pp, cp or pp,cp: each schedule and cp strategy, "
        "with FSDP + SP, and their pairs, proven or refused with the reason)",
        shown_default="none",
    )

    def __post_init__(self):
        check_fields(self)  # library users never pass argparse's checks
        check_lora_flags(self)  # --lora-alpha without --lora-rank: one line, not dropped
