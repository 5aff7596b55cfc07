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
from meshlm.ranges import Range

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


# ---- long context: the same four flags on train, verify, bench and plan (issue 24) ----
ATTENTION_KINDS = ("plain", "blockwise")  # model.config.ATTENTION
CP_STRATEGY_NAMES = ("ring", "allgather")  # parallel.layout.CP_STRATEGIES


@dataclasses.dataclass(frozen=True)
class LongContext:
    """The long-context settings, a base of each command's settings dataclass (their flags come first).
    Like remat they change speed and memory, not the model: a run resumes under other values."""

    # plain (scores [B, H, T, T]) or blockwise (flash attention in blocks: memory O(T))
    attention: str = setting(
        "plain",
        "attention: plain (scores [B, H, T, T]) or blockwise (flash attention in blocks: memory O(T))",
        choices=ATTENTION_KINDS,
    )
    # queries and keys per block of blockwise attention (and of each --cp ring step)
    attn_block: int = setting(
        512, "queries and keys per block (blockwise attention, and each --cp ring step)", valid=Range(int, 1)
    )
    # context-parallel shards: the sequence split over them (data, not weights)
    cp: int = setting(
        1,
        "context-parallel shards: the sequence split over them (dp x cp x mp devices)",
        valid=Range(int, 1),
    )
    # ring (K/V passed around the cp axis) or allgather (K/V gathered once per layer)
    cp_strategy: str = setting(
        "ring",
        "with --cp: ring (K/V passed around the cp axis) or allgather (K/V gathered once per layer)",
        choices=CP_STRATEGY_NAMES,
    )
