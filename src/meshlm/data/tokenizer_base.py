"""The tokenizer interface every data and generation path uses (``Tokenizer``), below both of its
implementations: ``data.tokenizer`` (the byte tokenizer) and ``data.hf_tokenizer``
(a tokenizer.json) import it, and it imports neither, so neither imports the other back.

This module must not import jax: it runs before the CLI has chosen the devices.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType

import numpy as np

from meshlm.errors import DataError


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype holding every id of a vocabulary (uint8 for bytes)."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if vocab_size <= np.iinfo(dtype).max + 1:
            return np.dtype(dtype)
    raise DataError(f"vocab_size={vocab_size} does not fit in uint32 token ids")


class Tokenizer:
    """The interface: subclasses set ``kind``, ``vocab_size``, ``eod_id`` and implement the methods."""

    kind: str  # "bytes" or "hf": what checkpoint metadata records
    vocab_size: int  # ids are in [0, vocab_size)
    eod_id: int  # ends each document in a stream; generation stops on it
    # The files a transformers tokenizer comes with (name -> text: tokenizer_config.json with its chat
    # template and special tokens, chat_template.jinja, ...), carried verbatim wherever it is saved
    # (``meshlm.data.tokenizer_files.COMPANIONS``); not part of the fingerprint.
    files: Mapping[str, str] = MappingProxyType({})

    def encode(self, text: str) -> np.ndarray:
        """int32 ids of ``text`` (a document's tokens, no special tokens added)."""
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """``encode`` of each text (implementations may run them in parallel)."""
        return [self.encode(t) for t in texts]

    def encode_prompt(self, text: str) -> np.ndarray:
        """int32 ids of a prompt: what the tokenizer adds by default (e.g. a BOS) included."""
        return self.encode(text)

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """Text of ``ids``; never raises (invalid bytes become U+FFFD)."""
        raise NotImplementedError

    @property
    def token_bytes(self) -> np.ndarray:
        """int32[vocab_size]: UTF-8 bytes of each id's text (EOD counts 1, as the NUL byte)."""
        raise NotImplementedError

    @property
    def fingerprint(self) -> str:
        """A stable hash of the definition: equal tokenizers, equal fingerprints."""
        raise NotImplementedError

    def to_json(self) -> str | None:
        """The tokenizer.json text that recreates it, or None for the byte tokenizer."""
        raise NotImplementedError

    @property
    def dtype(self) -> np.dtype:
        """The storage dtype of a token stream: uint8 for bytes, uint16 when it fits, else uint32."""
        return token_dtype(self.vocab_size)

    def describe(self) -> str:
        return f"{self.kind} tokenizer ({self.vocab_size} ids, fingerprint {self.fingerprint[:12]})"
