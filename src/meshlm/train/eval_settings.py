"""What ``meshlm eval`` measures, as one settings dataclass: ``train.evaluation.evaluate`` reads it and
the command's flags are built from its fields (``meshlm.cli.common.add_flags``). No JAX here: the CLI
builds its parser from it before choosing devices."""

from __future__ import annotations

from dataclasses import dataclass

from meshlm.data.records import DEFAULT_FIELD
from meshlm.data.store import SPLITS, looks_like_store
from meshlm.errors import ConfigError
from meshlm.ranges import NON_NEGATIVE_INT, POSITIVE_INT
from meshlm.settings import SEQ_LEN_DEFAULT_TEXT, check_fields, setting


@dataclass(frozen=True)
class EvalConfig:
    """What ``meshlm eval`` measures; the command's flags are built from these fields."""

    checkpoint: str = setting("", "run directory (newest step) or one step's directory (required)")
    data: tuple[str, ...] = setting(
        (), "text, .jsonl(.gz/.zst), .parquet files, directories or globs (all of it), or a token store"
    )
    split: str = setting("val", "a token store's split", choices=SPLITS)
    seq_len: int = setting(0, "tokens per window", shown_default=SEQ_LEN_DEFAULT_TEXT, valid=NON_NEGATIVE_INT)
    batch_size: int = setting(8, "windows per step, split over dp", valid=POSITIVE_INT)
    text_field: str = setting(DEFAULT_FIELD, "the text field of JSONL / Parquet / dataset rows")
    tokenizer: str = setting("", "tokenizer.json for a checkpoint converted without one (default: its own)")

    def __post_init__(self):
        check_fields(self)
        if not self.checkpoint:
            raise ConfigError("no checkpoint to evaluate: pass --checkpoint DIR")
        if not self.data:
            raise ConfigError("no data to evaluate: pass --data PATH (text, JSONL/Parquet, or a token store)")


def check_split(ecfg: EvalConfig) -> None:
    """``--split`` picks a token store's split; raw text has none (all of it is evaluated), so any split
    but the default is refused there rather than ignored."""
    raw = not (len(ecfg.data) == 1 and looks_like_store(ecfg.data[0]))
    if raw and ecfg.split != "val":
        raise ConfigError(
            f"--split {ecfg.split} picks a token store's split, but --data is raw text, evaluated whole "
            "(it has no splits); drop --split, or pass a store made by `meshlm data prepare`"
        )
