"""Tokenizers: the byte tokenizer.

``Tokenizer`` (the interface, in ``meshlm.data.tokenizer_base``; re-exported here) is what the rest of
meshlm sees: ``vocab_size``, ``eod_id`` (the end-of-document id that ends every document in a token
stream and stops generation), ``encode``/``decode``, ``token_bytes`` (the UTF-8 length of each id's
text, for bits per byte) and ``fingerprint`` (a stable hash of the tokenizer's definition). Two
implementations: ``ByteTokenizer`` here (the default) and a Hugging Face ``tokenizers`` one
(``meshlm.data.hf_tokenizer``). ``data.tokenizer_files.load_tokenizer`` turns a spec ("bytes", a
tokenizer.json, or a directory holding one) into either.

The byte tokenizer: the vocabulary is ``VOCAB_SIZE = 256`` and one token is one byte (which is why
``bits_per_byte`` of its loss is just the loss in bits). Id ``EOD = 0``, the NUL byte, ends every
document: text files do not contain NUL, and any NUL byte that does occur (in a file, or in text given
to ``encode``) is dropped, so a 0 in a stream always means end-of-document.

This module must not import jax: it runs before the CLI has chosen the devices.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from meshlm.data.tokenizer_base import Tokenizer, token_dtype  # noqa: F401 - token_dtype: re-exported

VOCAB_SIZE = 256
EOD = 0  # end-of-document id: the NUL byte
BYTES = "bytes"  # the spec (and checkpoint metadata) naming the byte tokenizer


def encode(text: str) -> np.ndarray:
    """UTF-8 bytes of ``text`` as int32 ids. NUL characters are dropped: 0 is reserved for EOD."""
    # "replace" so lone surrogates (e.g. from odd file names) cannot make encoding raise.
    data = text.encode("utf-8", errors="replace").replace(b"\0", b"")
    return np.frombuffer(data, dtype=np.uint8).astype(np.int32)


def decode(ids: Iterable[int] | np.ndarray) -> str:
    """Text of integer ``ids``; never raises. Invalid UTF-8 and ids outside [0, 256) become U+FFFD.

    EOD ids decode to "\\x00"; split on it to get documents.
    """
    arr = np.asarray(ids, dtype=np.int64).reshape(-1)
    bad = (arr < 0) | (arr >= VOCAB_SIZE)
    if not bad.any():
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
    # Decode the runs between bad ids separately so a bad id never glues bytes across itself.
    parts, start = [], 0
    for i in np.flatnonzero(bad):
        parts.append(decode(arr[start:i]))
        start = int(i) + 1
    parts.append(decode(arr[start:]))
    return "\ufffd".join(parts)


def bits_per_byte(loss_nats: float, bytes_per_token: float = 1.0) -> float:
    """Mean cross-entropy in nats per token -> bits per byte of the original text.

    ``bytes_per_token``: the targets' UTF-8 bytes / their number (1 for the byte tokenizer), so the
    result is (sum of target losses) / ln 2 / (sum of target bytes): comparable across tokenizers.
    """
    return float(loss_nats) / math.log(2) / float(bytes_per_token)


class ByteTokenizer(Tokenizer):
    """One id per UTF-8 byte; EOD is the NUL byte. The default tokenizer."""

    kind = BYTES
    vocab_size = VOCAB_SIZE
    eod_id = EOD

    def encode(self, text: str) -> np.ndarray:
        return encode(text)

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        return decode(ids)

    @property
    def token_bytes(self) -> np.ndarray:
        return np.ones(VOCAB_SIZE, np.int32)

    @property
    def fingerprint(self) -> str:
        return BYTES

    def to_json(self) -> None:
        return None
