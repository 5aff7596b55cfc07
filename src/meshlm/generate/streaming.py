"""Host-side outputs of generation: tokenizers, incremental decoding to text, stopping, results.

Stopping (host side, per step): ``max_new_tokens``, an end-of-document id (``data.EOD``, or any of a
model's list of EOS ids; kept in ``tokens``, not in ``text``), or a stop string (``text`` ends before
it; generation stops at the step that completes it). Text streams through ``on_token(index, token,
piece)``: bytes are decoded incrementally (a multi-byte UTF-8 character arrives whole) and text that
could begin a stop string is held back until it cannot, so the pieces of a row always join to exactly
its ``text``.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from numbers import Integral

import numpy as np

from meshlm.data.tokenizer import ByteTokenizer

__all__ = ["ByteTokenizer", "ByteStream", "DiffStream", "GenerationResult", "OutputRow", "make_stream"]

OnToken = Callable[[int, int, str], None]  # (prompt index, token id, newly printable text)
Stops = int | Iterable[int] | None  # the id(s) that end generation (None: none)


class ByteStream:
    """Incremental UTF-8: a multi-byte character comes out once its last byte arrives."""

    def __init__(self):
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token: int) -> str:
        return self._dec.decode(bytes([token])) if 0 <= token < 256 else "\ufffd"

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


class DiffStream:
    """Any tokenizer with ``decode(ids) -> str``: emit only completed text, never half a character or
    half a merge. Decodes the growing tail ``ids[prefix:]`` and emits what it adds to the text of
    ``ids[prefix:read]`` (already emitted; kept as context for decoders that look at the previous
    token), waiting while the text ends in U+FFFD (a partial character) or earlier text changed.
    Work per token is bounded by the tail, not the whole sequence."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids = tokenizer, []
        self.prefix = self.read = 0  # ids[prefix:read]: the context, already emitted

    def _pending(self) -> str | None:
        """Text the tail adds to the context, or None while it is not final."""
        done = self.tokenizer.decode(self.ids[self.prefix : self.read])
        text = self.tokenizer.decode(self.ids[self.prefix :])
        return text[len(done) :] if text.startswith(done) else None

    def feed(self, token: int) -> str:
        self.ids.append(token)
        new = self._pending()
        if not new or new.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return new

    def flush(self) -> str:
        return self._pending() or ""


def make_stream(tokenizer) -> ByteStream | DiffStream:
    """A fresh incremental decoder for one row: bytes directly, any other tokenizer by differences."""
    return ByteStream() if isinstance(tokenizer, ByteTokenizer) else DiffStream(tokenizer)


def _holdback(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    longest = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest


@dataclass
class GenerationResult:
    prompt: str | list[int]
    tokens: list[int]  # generated ids (a final EOD included)
    text: str  # generated text (without EOD, ending before a stop string)
    prefill_tokens_per_s: float  # whole batch: real prompt tokens / prefill wall time
    decode_tokens_per_s: float  # whole batch: tokens made by decode steps / their wall time (0: none)
    finish_reason: str  # "length", "eod" or "stop"

    def to_json(self) -> dict:
        return asdict(self)


class OutputRow:
    """One prompt's output: its ids, its text so far, why it ended; streams through ``on_token``."""

    def __init__(self, index: int, stream, stops: Sequence[str], eod: Stops, on_token: OnToken | None):
        self.index, self.stream, self.stops, self.on_token = index, stream, stops, on_token
        self.eod = stop_ids(eod)
        self.ids: list[int] = []
        self.text, self.sent, self.finish = "", 0, None

    def push(self, token: int, last: bool) -> None:
        self.ids.append(token)
        start = len(self.text)
        if token in self.eod:
            self.finish = "eod"
        else:
            self.text += self.stream.feed(token)
        if last and self.finish is None:
            self.finish = "length"
        if self.finish:
            self.text += self.stream.flush()
        self._find_stop(start)
        end = len(self.text) if self.finish else len(self.text) - _holdback(self.text, self.stops)
        piece, self.sent = self.text[self.sent : end], max(self.sent, end)
        if self.on_token is not None:
            self.on_token(self.index, token, piece)

    def _find_stop(self, start: int) -> None:
        hits = [self.text.find(s, max(0, start - len(s) + 1)) for s in self.stops]
        hits = [i for i in hits if i >= 0]
        if hits:
            self.text, self.finish = self.text[: min(hits)], "stop"

    def result(self, prompt, rates: tuple[float, float]) -> GenerationResult:
        """This row's result; ``rates``: the whole batch's (prefill, decode) tokens per second."""
        prompt = prompt if isinstance(prompt, str) else [int(t) for t in prompt]
        return GenerationResult(prompt, self.ids, self.text, rates[0], rates[1], self.finish)


def stop_ids(eod: Stops) -> frozenset[int]:
    """The ids that end generation: one end-of-document id, several (Llama 3's ``eos_token_id`` list:
    any of them stops), or None: none."""
    if eod is None:
        return frozenset()
    return frozenset([int(eod)] if isinstance(eod, Integral) else (int(i) for i in eod))


def push_tokens(rows: list[OutputRow], nxt: np.ndarray, last: bool) -> int:
    """Give each unfinished row its new token (``nxt`` [B'] host ids, global); returns how many rows
    were still running."""
    live = [r for r in rows if r.finish is None]
    for r in live:
        r.push(int(nxt[r.index]), last)
    return len(live)


def push_steps(rows: list[OutputRow], out: np.ndarray, steps: int, max_new: int) -> tuple[int, int]:
    """Give the rows the tokens ``out`` [B', n] of n decode steps in order (a chunk's), until every row
    has stopped (the chunk's later tokens are then dropped): (steps after them, tokens pushed to
    running rows). ``steps``: the steps before them; the last of ``max_new`` ends every row."""
    pushed = 0
    for j in range(out.shape[1]):
        if not any(r.finish is None for r in rows):
            break
        steps += 1
        pushed += push_tokens(rows, out[:, j], steps == max_new)
    return steps, pushed
