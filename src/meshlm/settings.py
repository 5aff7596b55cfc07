"""Settings dataclasses whose fields describe themselves: one declaration gives a command its flags,
its validation and (for training) its resume rule.

``setting(default, help, ...)`` is a dataclass field whose metadata holds its help text, its valid
range or choices, and how the command line exposes it. ``meshlm.cli.common.add_flags`` builds a
command's flags from such a dataclass and ``settings_from`` builds the dataclass from the parsed
flags; ``check_fields`` enforces ranges and choices for library users, who never go through argparse.

This module must not import JAX: the CLI builds its parsers from it before choosing devices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

from meshlm.errors import ConfigError
from meshlm.parallel.axes import CP, AxisFacts
from meshlm.ranges import POSITIVE_INT, Range

# How a command exposes a field: a flag of its own, a flag the shared ``add_common`` already adds
# (same dest), or not at all.
CLI_FLAG, CLI_COMMON, CLI_HIDDEN = "flag", "common", "hidden"

# The default sequence length of every command (train, verify, bench, plan): seq_len 0 means
# min(DEFAULT_SEQ_LEN, the model's max_seq_len) (``model.config.default_seq_len``).
DEFAULT_SEQ_LEN = 128
SEQ_LEN_DEFAULT_TEXT = f"min({DEFAULT_SEQ_LEN}, the model's max_seq_len)"


class Switch(NamedTuple):
    """A value-less flag that sets its field to ``value`` (``--bf16`` -> compute_dtype="bfloat16")."""

    flag: str  # e.g. "--bf16"
    value: Any  # the field's value when the flag is given
    help: str  # the flag's help text


def setting(
    default: Any,
    help: str,
    *,
    resume_must_match: bool = False,
    cli: str = CLI_FLAG,
    switch: Switch | None = None,
    shown_default: str | None = None,
    valid: Range | None = None,
    choices: tuple[str, ...] | None = None,
    parse: Callable[[str], Any] | None = None,
    flag: str | None = None,
) -> Any:
    """A dataclass field whose metadata says what it means and how the CLI (and resume) treat it.

    ``resume_must_match``: the value changes the computation, so a resumed run must use the saved one.
    ``shown_default``: what the help says the default is, where the literal value would mislead.
    ``valid``: the values a number accepts; ``check_fields`` and the CLI's flag type both enforce it.
    ``choices``: the values a string accepts (enforced the same two ways).
    ``parse``: the flag's own argparse type, for values a ``Range`` cannot describe (e.g. "80GiB").
    ``flag``: the flag's name where it is not the field's in kebab case.
    """
    metadata = {
        "help": help,
        "resume_must_match": resume_must_match,
        "cli": cli,
        "switch": switch,
        "shown_default": shown_default,
        "valid": valid,
        "choices": choices,
        "parse": parse,
        "flag": flag,
    }
    return dataclasses.field(default=default, metadata=metadata)


def flag_name(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def check_fields(obj) -> None:
    """Every field's range and choices (None: "not given", always valid): one-line errors naming
    the flag and its default."""
    for f in dataclasses.fields(obj):
        value, valid, choices = getattr(obj, f.name), f.metadata.get("valid"), f.metadata.get("choices")
        if value is None:
            continue
        if valid is not None and (problem := valid.problem(f.name, value)):
            raise ConfigError(f"{problem} (the default is {flag_name(f)} {f.default})")
        if choices and value not in choices:
            raise ConfigError(f"{f.name}={value!r}; valid: {', '.join(choices)}")


# ---- the mesh: the same flags on every command that takes one (issue 32) ----
ATTENTION_KINDS = ("auto", "plain", "blockwise", "flash")  # "auto", then model.config.ATTENTION
# flash under --cp runs the ring's steps (``model.flash_ring``), not the all-gather: refused by the
# commands before any device, and by the model (``transformer.check_context``)
FLASH_UNDER_CP = "--attention flash runs --cp as a ring; drop --cp-strategy allgather (or use blockwise)"
CP_STRATEGY_NAMES = ("ring", "allgather")  # parallel.layout.CP_STRATEGIES
PP_SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved")  # parallel.pipeline_schedule.SCHEDULES
# What a command that lacks an option runs without (its flag's help and its one-line refusal).
WITHOUT = {
    "pp": "a pipeline",
    "microbatches": "a pipeline",
    "pp_schedule": "a pipeline",
    "virtual_stages": "a pipeline",
    "cp": "context parallelism",
    "cp_strategy": "context parallelism",
    "fsdp": "FSDP",
    "sp": "sequence parallelism",
    "ep": "expert parallelism",
}


@dataclasses.dataclass(frozen=True)
class MeshFlags:
    """The mesh's options, one base of every mesh-taking command's settings (train, verify, bench,
    plan; eval, generate and memory use it alone): --pp and its schedule, --cp and its strategy,
    --fsdp, --sp, --ep. The mesh's DPxMP sizes are --mesh (``cli.common.add_common``). ``layout_options``
    is what ``Layout(dp, mp, **options)`` takes: the one place these fields become a layout's.
    They change speed and memory, not the model: a run resumes under other values."""

    pp: int = setting(
        1, "pipeline stages: the layer stack split over an outermost pp mesh axis", valid=POSITIVE_INT
    )
    microbatches: int | None = setting(
        None, "with --pp: micro-batches per step", shown_default="pp", valid=POSITIVE_INT
    )
    pp_schedule: str = setting("1f1b", "with --pp: the pipeline schedule", choices=PP_SCHEDULE_NAMES)
    virtual_stages: int = setting(
        1, "with --pp-schedule interleaved: layer chunks per device (V)", valid=POSITIVE_INT
    )
    # context-parallel shards: the sequence split over them (data, not weights)
    cp: int = setting(
        1,
        "context-parallel shards: the sequence split over them (dp x cp x mp devices)",
        valid=POSITIVE_INT,
    )
    # ring (K/V passed around the cp axis) or allgather (K/V gathered once per layer)
    cp_strategy: str = setting(
        "ring",
        "with --cp: ring (K/V passed around the cp axis) or allgather (K/V gathered once per layer)",
        choices=CP_STRATEGY_NAMES,
    )
    fsdp: bool = setting(False, "FSDP (ZeRO-3): weights and AdamW moments also split over dp")
    sp: bool = setting(False, "sequence parallelism: activations between blocks split over mp")
    # expert-parallel shards: ep of the dp data shards hold different experts (ep divides dp)
    ep: int = setting(
        1,
        "expert-parallel shards: the experts split over ep of the dp data shards (ep divides dp; "
        "--mesh 2x2 --ep 2: 4 devices)",
        valid=POSITIVE_INT,
    )

    def on(self, axis: str) -> bool:
        """Whether these flags split over ``axis`` (before any layout exists): the layout's own rule,
        ``parallel.axes.AxisFacts.on``."""
        return AxisFacts.on(self, axis)

    def layout_options(self) -> dict[str, Any]:
        """The Layout's fields these flags set. ``microbatches`` defaults to pp: 1 without --pp, the
        layout's own default (a layout without a pipeline refuses any other)."""
        return {
            "pp": self.pp,
            "microbatches": self.microbatches or self.pp,
            "pp_schedule": self.pp_schedule,
            "virtual_stages": self.virtual_stages,
            "cp": self.cp,
            "cp_strategy": self.cp_strategy,
            "fsdp": self.fsdp,
            "sp": self.sp,
            "ep": self.ep,
        }

    def given(self) -> list[str]:
        """The fields not at their defaults (what a command lacking them refuses)."""
        return [f.name for f in dataclasses.fields(MeshFlags) if getattr(self, f.name) != f.default]


MESH_OPTIONS = tuple(f.name for f in dataclasses.fields(MeshFlags))


# --attention auto picks flash on a TPU from this many tokens a row. Measured on a TPU v5e (bf16, the
# llama-100m step, 8192 tokens a step, 7 December 2026 18:05 UTC, after splash's fused backward;
# docs/benchmarks.md "Choosing --attention auto"): plain is 1.14x faster than flash at 256 tokens;
# flash is 1.06x faster at 512, 1.23x at 1024 and far ahead from 2048 on (plain's [B, H, T, T] scores
# grow as T^2 and run out of memory at 8192). Blockwise was never the fastest.
FLASH_MIN_SEQ = 512


@dataclasses.dataclass(frozen=True)
class LongContext:
    """The attention and loss-chunk settings of train, verify, bench and plan, a base of their settings
    dataclasses.
    Like remat they change speed and memory, not the model: a run resumes under other values."""

    # auto (``attention_kind``: flash on a TPU where it applies and pays, else plain), plain ([B, H, T, T]),
    # blockwise (flash attention in blocks: memory O(T)) or flash (JAX's fused Pallas kernel,
    # ``model.flash``: compiled on a TPU, interpret mode elsewhere)
    attention: str = setting(
        "auto",
        f"attention: auto (on a TPU flash where it applies and rows are >= {FLASH_MIN_SEQ} tokens, else "
        "plain: measured faster below), plain (scores [B, H, T, T]), "
        "blockwise (flash attention in blocks: memory O(T)) or flash (the fused Pallas TPU kernel; "
        "interpret mode off a TPU)",
        choices=ATTENTION_KINDS,
    )
    # queries and keys per block of blockwise attention (and of each --cp ring step)
    attn_block: int = setting(
        512, "queries and keys per block (blockwise attention, and each --cp ring step)", valid=Range(int, 1)
    )
    # The head's cross-entropy in chunks of tokens (``model.chunked_xent``): ``ModelConfig.loss_chunk``
    loss_chunk: int = setting(
        0,
        "the head's cross-entropy in chunks of at most this many tokens per shard, its gradients computed "
        "in the forward, so the [B, T, V] float32 logits and their gradient never exist whole (0: off; "
        "the whole loss's three head matmuls; docs/memory.md)",
        valid=Range(int, 0),
    )

    def attention_kind(self, backend: str, seq_len: int, x64: bool = False) -> str:
        """--attention as the model takes it (``ModelConfig.attention``): "auto", the default, is flash
        on a TPU (``backend``: ``jax.default_backend()``) for rows of ``FLASH_MIN_SEQ`` tokens or more
        where the kernel applies everywhere -- no --cp (flash's ring refuses windows and chunks, which a
        model's config decides: ``--attention flash`` asks for it) and not float64 (--x64: the kernel
        computes in float32) -- else plain. ``seq_len``: the run's tokens a row (resolved)."""
        if self.attention != "auto":
            return self.attention
        # (commands without --cp: one sequence per shard)
        one_sequence = not (isinstance(self, MeshFlags) and self.on(CP))
        pays = seq_len >= FLASH_MIN_SEQ
        return "flash" if backend == "tpu" and one_sequence and not x64 and pays else "plain"


# --moe-dispatch: "auto", then model.config.DISPATCHES (here: this module imports no model code)
DISPATCH_CHOICES = ("auto", "blocks", "ragged_dot", "gmm", "dense")
FAST_DISPATCH = {"tpu": "ragged_dot", "gpu": "ragged_dot"}  # "auto" per backend; any other: "blocks"


def dispatch_for(choice: str, backend: str) -> str:
    """--moe-dispatch as the model takes it (``ModelConfig.moe_dispatch``): "auto", the default, is
    "ragged_dot" on a TPU or a GPU (``backend``: ``jax.default_backend()``), XLA's grouped matmul there
    (a TPU v5e ran the block scan's step at 4.5x ragged_dot's, docs/benchmarks.md), and "blocks"
    elsewhere (XLA:CPU pads ragged_dot to a dense dot of every row with every expert; the block scan
    is its fast one). A chosen one is kept.

    Resolved where a command starts, as ``--attention auto`` is (``LongContext``), not inside the
    model as ``model.layer_loop.straight_line_form`` is: the dispatch is read outside the model too
    (the planner's row bounds and collectives, the proof's controls that apply, bench's
    implementations), so the config every one of them reads must hold the dispatch that runs, never
    "auto"; the loop's form is read by nothing but the loop."""
    if choice not in DISPATCH_CHOICES:
        raise ConfigError(f"--moe-dispatch {choice!r}; valid: {', '.join(DISPATCH_CHOICES)}")
    return FAST_DISPATCH.get(backend, "blocks") if choice == "auto" else choice


def _tiling_text(text: str) -> str:
    """--gmm-tiling's text, checked (``parallel.gmm_tiling.parse_tiling``) and kept as given."""
    from meshlm.parallel.gmm_tiling import parse_tiling

    try:
        parse_tiling(text)
    except ConfigError as e:
        raise ValueError(str(e)) from None
    return text


@dataclasses.dataclass(frozen=True)
class ExpertDispatch:
    """How a mixture of experts reaches its experts, for train, verify, bench and plan (a base, as
    ``LongContext``). Like remat it changes speed and memory, not the values (the proof compares every
    dispatch with "dense"): a run resumes under another, and a dense model ignores it."""

    moe_dispatch: str = setting(
        "auto",
        "a mixture of experts' dispatch: auto (ragged_dot on a TPU or GPU, blocks elsewhere), blocks "
        "(sorted, a scan of block matmuls), ragged_dot (sorted, jax.lax.ragged_dot), gmm (sorted, JAX's "
        "Pallas megablox grouped matmul: compiled on a TPU, interpret mode elsewhere) or dense (every "
        "expert on every token: the proof's reference)",
        choices=DISPATCH_CHOICES,
    )

    gmm_tiling: str = setting(
        "auto",
        "--moe-dispatch gmm's kernel tiles: auto (from the shapes) or TM,TK,TN (rows, contraction and "
        "output columns of a tile; TK, TN capped to a divisor of each matmul's dimension)",
        parse=_tiling_text,
    )

    def dispatch_kind(self, backend: str) -> str:
        """--moe-dispatch as the model takes it (``ModelConfig.moe_dispatch``; ``backend``:
        ``jax.default_backend()`` where the command starts): ``dispatch_for``."""
        return dispatch_for(self.moe_dispatch, backend)

    def dispatch_fields(self, backend: str) -> dict[str, str]:
        """The model config's dispatch fields as the command runs them: ``moe_dispatch``
        (``dispatch_kind``) and ``moe_gmm_tiling`` (--gmm-tiling)."""
        return {"moe_dispatch": self.dispatch_kind(backend), "moe_gmm_tiling": self.gmm_tiling}


# ---- settings files (``--settings FILE``): TOML, one key per flag ----
def toml_text(values: dict[str, Any], comment: str = "") -> str:
    """``values`` (str, bool, int, float or lists of them; None: left out, the flag's default) as TOML
    ``key = value`` lines in order, after ``comment`` lines; ``tomllib`` reads them back equal."""
    lines = [f"# {line}" for line in comment.splitlines()]
    for key, value in values.items():
        if value is not None:
            lines.append(f"{key} = {_toml_value(key, value)}")
    return "\n".join(lines) + "\n"


def _toml_value(key: str, value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)  # TOML writes floats as Python does: 0.003, 1e-05, inf, nan
    if isinstance(value, str):
        return '"' + "".join(_toml_char(c) for c in value) + '"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(key, v) for v in value) + "]"
    raise ConfigError(f"setting {key}={value!r}: a settings file holds strings, numbers, booleans and lists")


def _toml_char(c: str) -> str:
    """A character of a TOML basic string: quote, backslash and control characters escaped."""
    if c in '"\\':
        return "\\" + c
    return f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c
