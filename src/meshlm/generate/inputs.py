"""Host-side inputs of generation: sampling settings, prompts (text, token ids or a file), stop
strings, the token budget, and the padded batch the compiled programs take.

Prompts are right-padded to one fixed length ``S`` (the cache length ``max_len``) and to a batch
that is a multiple of dp, so that neither prompt lengths nor the number of new tokens change a
compiled program's shapes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral
from pathlib import Path

import numpy as np

from meshlm.data.tokens import check_token_range
from meshlm.errors import GenerationError


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0  # 1.0: no nucleus cut
    seed: int = 0

    def check(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise GenerationError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if self.top_k < 0:
            raise GenerationError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise GenerationError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p}")

    def args(self) -> tuple:
        """(temperature, top_k, top_p) as the traced arguments of ``programs.sample``."""
        return np.float32(self.temperature), np.int32(self.top_k), np.float32(self.top_p)


def read_prompt_file(path: str | Path) -> str:
    """The whole file as one prompt, verbatim; an error names the file and the first bad byte."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise GenerationError(f"cannot read prompt file {path}: {e.strerror}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise GenerationError(
            f"prompt file {path} is not UTF-8: byte offset {e.start} (0x{data[e.start]:02x}) {e.reason}; "
            "re-encode it as UTF-8 (e.g. iconv -t UTF-8)"
        ) from None


def check_utf8(text: str, what: str) -> None:
    """Refuse text that was not UTF-8: Python keeps an argument's invalid bytes as lone surrogates,
    which a tokenizer would reject with a TypeError or silently replace."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        offset, code = len(text[: e.start].encode("utf-8")), ord(text[e.start])
        byte = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"U+{code:04X}"
        raise GenerationError(
            f"{what} is not valid UTF-8 ({byte} at byte {offset}); pass UTF-8 text "
            "(re-encode it, e.g. with iconv -t UTF-8)"
        ) from None


def check_stops(stop) -> tuple[str, ...]:
    """One stop string, several, or None -> a tuple of non-empty strings."""
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if any(not isinstance(s, str) or not s for s in stops):
        raise GenerationError(f"stop strings must be non-empty strings, got {stops!r}")
    return stops


def encode_prompt(tokenizer, vocab_size: int, index: int, prompt) -> np.ndarray:
    """Prompt ``index`` (text, or token ids) -> its ids [n], checked against the vocabulary."""
    encode = getattr(tokenizer, "encode_prompt", tokenizer.encode)  # e.g. with the tokenizer's BOS
    if isinstance(prompt, str):
        check_utf8(prompt, f"prompt {index}")
    ids = encode(prompt) if isinstance(prompt, str) else prompt
    ids = np.asarray(ids)
    if ids.ndim != 1:
        raise GenerationError(f"prompt {index} must be a string or a flat list of token ids")
    if ids.size == 0:
        raise GenerationError(f"prompt {index} is empty; give at least one token to continue from")
    check_token_range(ids, vocab_size, f"prompt {index}")
    return ids.astype(np.int32)


def check_budget(ids: list[np.ndarray], max_new_tokens: int, max_len: int) -> None:
    """Every prompt plus ``max_new_tokens`` must fit in the cache of ``max_len`` tokens."""
    s = max_len
    if not ids:
        raise GenerationError("no prompts given; pass at least one")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, Integral) or max_new_tokens < 1:
        raise GenerationError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    for i, row in enumerate(ids):
        if len(row) > s:
            raise GenerationError(f"prompt {i} has {len(row)} tokens, longer than the context of {s}")
        if len(row) == s:  # no max_new_tokens fits: never advise one below 1 (refused above)
            raise GenerationError(
                f"prompt {i} ({len(row)} tokens) fills the whole context of {s} tokens, leaving no room "
                "for a new token; use a shorter prompt"
            )
        if len(row) + max_new_tokens > s:
            raise GenerationError(
                f"prompt {i} ({len(row)} tokens) + max_new_tokens={max_new_tokens} exceeds the "
                f"context of {s} tokens; use max_new_tokens <= {s - len(row)} or a shorter prompt"
            )


def pad_prompts(ids: list[np.ndarray], dp: int, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [B', S], lengths [B']), global: right-padded to S = ``max_len``, B' the next multiple
    of dp (extra rows: one EOD token, ignored)."""
    b = -(-len(ids) // dp) * dp
    tokens = np.zeros((b, max_len), np.int32)
    lengths = np.ones(b, np.int32)
    for i, row in enumerate(ids):
        tokens[i, : len(row)], lengths[i] = row, len(row)
    return tokens, lengths


def prompt_doc_starts(tokens: np.ndarray, lengths: np.ndarray, eod: int) -> np.ndarray:
    """[B]: where the last document of each right-padded prompt (tokens [B, S], lengths [B]) starts:
    its last EOD, else 0 (``--doc-mask``, ``eod`` >= 0; -1: zeros, unused)."""
    t = np.arange(tokens.shape[1])
    inside = t[None, :] < np.asarray(lengths)[:, None]
    return np.max(np.where(inside & (tokens == eod) & (eod >= 0), t, 0), axis=1)


def next_doc_starts(starts: np.ndarray, fed, positions, eod: int) -> np.ndarray:
    """[B]: where each row's document starts once ``fed`` [B] is fed at ``positions`` [B]: an EOD starts
    a new document, so generation masks the documents as training did (``--doc-mask``)."""
    return np.where((np.asarray(fed) == eod) & (eod >= 0), positions, starts)


def check_teacher_forced(tokens, lengths, vocab_size: int, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [B, T], lengths [B]) as arrays, checked for ``generator.logits_with_cache``."""
    tokens, lengths = np.asarray(tokens), np.asarray(lengths, np.int64)
    if tokens.ndim != 2 or lengths.shape != tokens.shape[:1]:
        raise GenerationError(f"tokens must be [B, T] with lengths [B]; got {tokens.shape}, {lengths.shape}")
    check_token_range(tokens, vocab_size, "tokens")
    t = tokens.shape[1]
    if t > max_len or lengths.min() < 1 or lengths.max() > t:
        raise GenerationError(f"need 1 <= lengths <= T={t} <= max_len={max_len}; got {lengths}")
    return tokens, lengths
