"""Byte-level tokenizer: a token id is one UTF-8 byte of the text.

The vocabulary is ``VOCAB_SIZE = 256`` and one token is one byte (which is why ``bits_per_byte`` is
just the loss in bits). Id ``EOD = 0``, the NUL byte, ends every document: text files do not contain
NUL, and any NUL byte that does occur (in a file, or in text given to ``encode``) is dropped, so a 0
in a stream always means end-of-document.

This module must not import jax: it runs before the CLI has chosen the devices.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

VOCAB_SIZE = 256
EOD = 0  # end-of-document id: the NUL byte


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


def bits_per_byte(loss_nats: float) -> float:
    """Mean cross-entropy in nats per token -> bits per byte (loss / ln 2: one token is one byte).

    Unlike the loss of a subword model, this is comparable across tokenizers and to compressors.
    """
    return float(loss_nats) / math.log(2)
