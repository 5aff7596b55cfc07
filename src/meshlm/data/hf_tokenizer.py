"""A Hugging Face ``tokenizers`` tokenizer (a tokenizer.json) behind meshlm's ``Tokenizer`` interface.

The end-of-document id is one of the tokenizer's special tokens: the one named when it is made (from
checkpoint metadata, or ``eos_token`` in a tokenizer_config.json next to the file: read by
``data.tokenizer_files``), else the first of
``EOD_NAMES`` it has. ``token_bytes`` is exact for byte-level BPE (each vocabulary entry maps back to
its bytes) and for SentencePiece-style byte fallback (``<0xNN>`` is one byte); otherwise it is the
UTF-8 length of the id's decoded text. Special tokens count 0 bytes, except EOD, which counts 1 like
the byte tokenizer's NUL.

This module must not import jax: it runs before the CLI has chosen the devices.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Sequence
from functools import cached_property
from pathlib import Path

import numpy as np

from meshlm.data.tokenizer_base import Tokenizer
from meshlm.errors import DataError

EOD_TOKEN = "<|endoftext|>"  # the special token `meshlm tokenizer train` adds
# Special tokens that end a document, by preference, when nothing names one.
EOD_NAMES = (EOD_TOKEN, "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>", "<|eot_id|>")
_BYTE_FALLBACK = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level map, inverted: the printable character standing for each byte -> the byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _first_line(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


class HFTokenizer(Tokenizer):
    """A ``tokenizers.Tokenizer`` with a chosen end-of-document special token."""

    kind = "hf"

    def __init__(self, *, tokenizer, eod_token: str | None = None, source: str = "tokenizer"):
        self.tok, self.source = tokenizer, source
        vocab = tokenizer.get_vocab(with_added_tokens=True)  # text -> id
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0
        self.specials = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        if eod_token and eod_token not in self.specials and tokenizer.token_to_id(eod_token) is not None:
            self.specials[eod_token] = tokenizer.token_to_id(eod_token)  # named as EOS, not marked special
        names = [eod_token] if eod_token else [n for n in EOD_NAMES if n in self.specials]
        if not names or names[0] not in self.specials:
            have = ", ".join(sorted(self.specials)) or "none"
            want = repr(eod_token) if eod_token else f"one of {', '.join(EOD_NAMES)}"
            raise DataError(
                f"{source} has no end-of-document special token ({want}; its special tokens: {have}); "
                f"train one with `meshlm tokenizer train` or add {EOD_TOKEN!r} as a special token"
            )
        self.eod_token = names[0]
        self.eod_id = self.specials[self.eod_token]

    @classmethod
    def from_file(cls, path: str | Path, eod_token: str | None = None) -> HFTokenizer:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"cannot read tokenizer {path}: {_first_line(e)}") from e
        return cls.from_str(text, eod_token=eod_token, source=f"tokenizer {path}")

    @classmethod
    def from_str(cls, text: str, eod_token: str | None = None, source: str = "tokenizer") -> HFTokenizer:
        from tokenizers import Tokenizer as RawTokenizer

        try:
            raw = RawTokenizer.from_str(text)
        except Exception as e:  # the Rust side raises a bare Exception for any malformed file
            raise DataError(
                f"{source} does not load as a Hugging Face tokenizer.json ({_first_line(e)}); "
                "pass a tokenizer.json saved by `tokenizers` or `transformers`"
            ) from e
        return cls(tokenizer=raw, eod_token=eod_token, source=source)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def encode_prompt(self, text: str) -> np.ndarray:
        """As AutoTokenizer(text) does: with what the post-processor adds (Llama 3's BOS) — never
        dropped; but a prompt whose text already starts with that token keeps one, never two."""
        full = self.tok.encode(text).ids
        plain = self.tok.encode(text, add_special_tokens=False).ids
        if plain and len(full) > len(plain) and full[0] == plain[0] and full[1 : len(plain) + 1] == plain:
            full = full[1:]  # the text's own BOS, and the post-processor's again
        return np.asarray(full, dtype=np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """``encode`` of each text, in parallel threads."""
        encs = self.tok.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encs]

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        ids = [int(i) for i in np.asarray(ids, dtype=np.int64).reshape(-1)]
        parts, run = [], []
        for i in ids:  # an id outside the vocabulary becomes U+FFFD, as in the byte tokenizer
            if 0 <= i < self.vocab_size:
                run.append(i)
            else:
                parts, run = [*parts, run], []
        return "\ufffd".join(self.tok.decode(p, skip_special_tokens=False) for p in [*parts, run])

    @cached_property
    def token_bytes(self) -> np.ndarray:
        decoder = json.dumps(json.loads(self.tok.to_str()).get("decoder"))
        alphabet = byte_level_alphabet() if "ByteLevel" in decoder else None
        out = np.zeros(self.vocab_size, np.int32)
        for text, i in self.tok.get_vocab(with_added_tokens=True).items():
            if text in self.specials:
                out[i] = 1 if i == self.eod_id else 0
            elif alphabet is not None and all(c in alphabet for c in text):
                out[i] = len(text)  # one character per byte
            elif _BYTE_FALLBACK.match(text):
                out[i] = 1
            else:
                out[i] = len(self.tok.decode([i], skip_special_tokens=False).encode("utf-8"))
        out.setflags(write=False)
        return out

    @cached_property
    def fingerprint(self) -> str:
        h = hashlib.sha256(self.tok.to_str().encode("utf-8"))
        h.update(b"\0eod=" + self.eod_token.encode("utf-8"))
        return h.hexdigest()

    def to_json(self) -> str:
        return self.tok.to_str()
