"""The values a numeric setting accepts, declared once and checked in two places.

The CLI turns a ``Range`` into an argparse ``type=`` (``meshlm.cli.common.arg_type``) so a bad flag fails
while parsing, and library configs (``TrainConfig``) check the same ``Range`` themselves, since library
users never go through argparse. Both describe the range with ``Range.describe``, so the messages agree.

This module must not import JAX: the CLI builds its parsers from it before choosing devices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real


@dataclass(frozen=True)
class Range:
    """Values of ``kind`` (int or float) in [low, high]; ``low_open`` excludes ``low`` itself,
    ``high_open`` ``high``.

    Floats must also be finite: NaN passes no comparison test loudly, it just trains to garbage.
    ``note`` says what a special value means (e.g. "0: only at the end") and is shown in messages.
    """

    kind: type = int
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    note: str = ""
    high_open: bool = False

    def describe(self) -> str:
        """What a valid value is, e.g. "an integer >= 1" or "a finite number in (0, 1]"."""
        noun = "an integer" if self.kind is int else "a finite number"
        low, high = _show(self.low), _show(self.high)
        if self.low is not None and self.high is not None:
            text = f"{noun} in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"
        elif self.low is not None:
            text = f"{noun} {'>' if self.low_open else '>='} {low}"
        elif self.high is not None:
            text = f"{noun} <= {high}"
        else:
            text = noun
        return f"{text} ({self.note})" if self.note else text

    def contains(self, value) -> bool:
        if isinstance(value, bool) or not isinstance(value, Integral if self.kind is int else Real):
            return False
        if self.kind is not int and not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def problem(self, name: str, value) -> str | None:
        """None if ``value`` is valid, else "NAME must be <description>, got VALUE"."""
        return None if self.contains(value) else f"{name} must be {self.describe()}, got {value!r}"


def _show(x: float | None) -> str:
    if x is None:
        return ""
    return f"{x:,}" if isinstance(x, int) and abs(x) >= 10**6 else f"{x:g}"  # never 1.67772e+07


POSITIVE_INT = Range(int, 1)
NON_NEGATIVE_INT = Range(int, 0)
POSITIVE_FLOAT = Range(float, 0, low_open=True)
NON_NEGATIVE_FLOAT = Range(float, 0)
PROBABILITY = Range(float, 0, 1, low_open=True)
# The longest sequence a run or a store takes: 2^24 (16,777,216 tokens) is above any model's context (the
# longest presets and converted families: 1M-10M). A row is padded to seq_len + 1 tokens (a chat or pair
# store's, DPO's pairs from JSONL): --seq-len 1000000000000 was a 7.28 TiB allocation, refused here while
# parsing instead. Rotary models accept a --seq-len above their max_seq_len (``beyond_max_seq_len``), so
# the model's own limit does not bound it.
MAX_SEQ_LEN = 2**24
STORE_SEQ_LEN = Range(int, 1, MAX_SEQ_LEN, note="tokens per row; no model has a longer context")
