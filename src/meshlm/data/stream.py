"""Token streams (the tokens of one split) and stateless batches of random windows.

The batch at step s is a pure function of (seed, s), so training resumes without any data-loader
state, and each data-parallel shard slices only its own rows.

This module must not import jax: it runs before the CLI has chosen the devices.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from meshlm.data.tokenizer import EOD, VOCAB_SIZE, ByteTokenizer, Tokenizer, token_dtype
from meshlm.errors import DataError

EVAL_SEED = 0x5EED_E7A1  # validation batches must not move when the training seed changes


# --- token streams -----------------------------------------------------------------------------


def read_document(path: Path) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as err:
        raise DataError(
            f"cannot read data file {path}: {err.strerror}; fix it or leave it out of the paths"
        ) from err
    return data.replace(b"\0", b"")  # NUL is EOD: a stray NUL must not end a document early


def invalid_utf8(data: bytes, text: str) -> int:
    """How many U+FFFD ``text`` (``data`` decoded with errors="replace") holds that ``data`` did not."""
    return text.count("\ufffd") - data.count("\ufffd".encode())


def note_invalid_utf8(docs: Sequence[bytes], texts: Sequence[str], tokenizer: Tokenizer) -> None:
    """One warning (a count, never silence) when documents that are not valid UTF-8 reach a text
    tokenizer: each invalid sequence becomes U+FFFD there (the byte tokenizer keeps every byte)."""
    bad = [n for n in map(invalid_utf8, docs, texts) if n]
    if bad:
        warnings.warn(
            f"{len(bad)} of {len(docs)} documents are not valid UTF-8: {sum(bad):,} invalid byte "
            f"sequences became U+FFFD for the {tokenizer.describe()} (re-encode them as UTF-8 to keep "
            "their text; the byte tokenizer keeps every byte)",
            stacklevel=3,
        )


class TokenStream:
    """The tokens of one split: each document followed by EOD, served as int32.

    A chat store's stream (``data.chat_store``) also has ``loss_mask`` (uint8, one per token) and
    ``row_len``: its tokens are packed rows of that many, and batches take whole rows.

    Stored in the smallest dtype of the vocabulary (``token_dtype``: uint8 for bytes, uint16 when it
    fits, else uint32). ``text_bytes``: UTF-8 bytes of the text it holds, each EOD counted as one
    (default: one per token, as for bytes).
    """

    loss_mask: np.ndarray | None = None  # [len] 1 where a token is trained on (chat stores only)
    row_len: int = 0  # packed rows of this many tokens (chat stores); 0: windows at any offset

    def __init__(
        self,
        tokens: np.ndarray | Sequence[int],
        files: Sequence[Path] = (),
        *,
        vocab_size: int = VOCAB_SIZE,
        eod_id: int = EOD,
        text_bytes: int | None = None,
    ):
        arr = np.asarray(tokens)
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise DataError(f"tokens must be a 1-D integer array, got {arr.dtype} {arr.shape}")
        if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
            what = "the byte vocabulary" if vocab_size == VOCAB_SIZE else "the tokenizer's vocabulary"
            raise DataError(f"token ids must be in [0, {vocab_size}) for {what}")
        self.vocab_size, self.eod_id = vocab_size, eod_id
        self.tokens = arr.astype(token_dtype(vocab_size))  # a private copy, compact
        self.tokens.setflags(write=False)
        self.files = tuple(files)  # the files it was read from (for reports and tests)
        self.text_bytes = len(self.tokens) if text_bytes is None else int(text_bytes)

    @classmethod
    def from_documents(cls, docs: Iterable[bytes], files: Sequence[Path] = ()) -> TokenStream:
        """Concatenate byte documents, dropping NULs and ending each with EOD."""
        parts = []
        for doc in docs:
            parts += [doc.replace(b"\0", b""), bytes([EOD])]
        return cls(np.frombuffer(b"".join(parts), dtype=np.uint8), files)

    @classmethod
    def from_texts(
        cls, docs: Sequence[bytes], tokenizer: Tokenizer, files: Sequence[Path] = ()
    ) -> TokenStream:
        """Documents (UTF-8 bytes; invalid bytes become U+FFFD) through ``tokenizer``, each ended by its
        EOD. The byte tokenizer takes the byte path (``from_documents``): the same stream as before."""
        if isinstance(tokenizer, ByteTokenizer):
            return cls.from_documents(docs, files)
        texts = [d.decode("utf-8", errors="replace") for d in docs]
        note_invalid_utf8(docs, texts, tokenizer)
        encoded = tokenizer.encode_batch(texts)
        eod = np.array([tokenizer.eod_id], np.int64)
        parts = [p for ids in encoded for p in (np.asarray(ids, np.int64), eod)]
        tokens = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        n_bytes = sum(len(t.encode("utf-8", errors="replace")) + 1 for t in texts)
        kw = {"vocab_size": tokenizer.vocab_size, "eod_id": tokenizer.eod_id, "text_bytes": n_bytes}
        return cls(tokens, files, **kw)

    @classmethod
    def from_files(cls, paths: Sequence[Path], tokenizer: Tokenizer | None = None) -> TokenStream:
        """One document per file, in the given order (default: bytes)."""
        if tokenizer is None or isinstance(tokenizer, ByteTokenizer):
            return cls.from_documents((read_document(p) for p in paths), paths)
        return cls.from_texts([read_document(p) for p in paths], tokenizer, paths)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_docs(self) -> int:
        return int(np.count_nonzero(self.tokens == self.eod_id))

    def windows(self, starts: np.ndarray | Sequence[int], length: int) -> np.ndarray:
        """int32[len(starts), length]: the tokens at starts[i] : starts[i] + length."""
        starts = np.asarray(starts, dtype=np.int64).reshape(-1)
        if starts.size and (starts.min() < 0 or starts.max() + length > len(self)):
            raise DataError(f"window of {length} tokens out of range of a {len(self)}-token stream")
        return self.tokens[starts[:, None] + np.arange(length)].astype(np.int32)


# --- batches -----------------------------------------------------------------------------------


StreamLike = TokenStream | np.ndarray


class Batcher:
    """Random windows of a stream; the batch at a step depends only on (seed, step).

    Row r of step s starts at offset ``default_rng([seed, s]).integers(0, len - seq_len, B)[r]``;
    inputs are tokens [o, o + seq_len) and targets the same window shifted by one token.
    """

    def __init__(self, stream: StreamLike, seq_len: int, global_batch: int, seed: int = 0):
        self.stream = stream if isinstance(stream, TokenStream) else TokenStream(stream)
        if seq_len < 1:
            raise DataError(f"seq_len must be >= 1, got {seq_len}")
        if global_batch < 1:
            raise DataError(f"global_batch must be >= 1, got {global_batch}")
        if seed < 0:
            raise DataError(f"seed must be >= 0 (numpy seeds are non-negative), got {seed}")
        n = len(self.stream)
        if self.stream.row_len and n < self.stream.row_len:
            raise DataError(
                "this split of the chat store has no packed row; prepare it from more conversations"
            )
        if seq_len >= n - 1 and not self.stream.row_len:
            raise DataError(
                f"seq_len={seq_len} needs at least {seq_len + 2} tokens but this split has {n};"
                " use a shorter seq_len or more data (for validation: a larger val_fraction)"
            )
        self.seq_len, self.global_batch, self.seed = seq_len, global_batch, seed
        self._num_offsets = n - seq_len  # offsets 0 .. n-seq_len-1: a window needs seq_len+1
        row = self.stream.row_len
        if row and seq_len != row - 1:
            raise DataError(
                f"this chat store packs rows of seq_len={row - 1} tokens (`data prepare --chat --seq-len`); "
                f"train with --seq-len {row - 1}, or prepare the store again with --seq-len {seq_len}"
            )
        if row:  # whole rows only: offsets are multiples of the row length
            self._num_offsets = n // row

    @property
    def keys(self) -> tuple[str, ...]:
        """The batch's entries: inputs and targets, and a chat store's loss_mask (of the targets)."""
        return ("inputs", "targets") + (() if self.stream.loss_mask is None else ("loss_mask",))

    def offsets(self, step: int) -> np.ndarray:
        """Start offsets of all global rows of ``step`` (cheap: B integers)."""
        if step < 0:
            raise DataError(f"step must be >= 0, got {step}")
        return self._draw(np.random.default_rng([self.seed, step]))

    def _draw(self, rng: np.random.Generator) -> np.ndarray:
        drawn = rng.integers(0, self._num_offsets, size=self.global_batch, dtype=np.int64)
        return drawn * self.stream.row_len if self.stream.row_len else drawn

    def _rows(self, shard: int, num_shards: int) -> slice:
        if num_shards < 1 or not 0 <= shard < num_shards:
            raise DataError(f"need 0 <= shard < num_shards, got shard={shard} of {num_shards}")
        if self.global_batch % num_shards:
            up = -(-self.global_batch // num_shards) * num_shards
            raise DataError(
                f"global_batch={self.global_batch} is not divisible by {num_shards} data shards;"
                f" use a multiple of {num_shards}, e.g. {up}"
            )
        per = self.global_batch // num_shards
        return slice(shard * per, (shard + 1) * per)

    def _make(self, offsets: np.ndarray) -> dict[str, np.ndarray]:
        window = self.stream.windows(offsets, self.seq_len + 1)
        out = {
            "inputs": np.ascontiguousarray(window[:, :-1]),
            "targets": np.ascontiguousarray(window[:, 1:]),
        }
        if self.stream.loss_mask is not None:  # the targets' mask: token t + 1 is row t's target
            at = np.asarray(offsets, np.int64)[:, None] + np.arange(1, self.seq_len + 1)
            out["loss_mask"] = np.ascontiguousarray(self.stream.loss_mask[at])
        return out

    def batch(self, step: int, *, shard: int = 0, num_shards: int = 1) -> dict[str, np.ndarray]:
        """{"inputs", "targets"}: int32[global_batch // num_shards, seq_len], rows of ``shard``.

        All offsets are drawn (so every shard agrees) but only this shard's windows are built.
        """
        rows = self._rows(shard, num_shards)
        return self._make(self.offsets(step)[rows])

    def eval_batches(self, num_batches: int) -> list[dict[str, np.ndarray]]:
        """``num_batches`` full batches from ``EVAL_SEED``: the same for every seed and step."""
        if num_batches < 0:
            raise DataError(f"num_batches must be >= 0, got {num_batches}")
        batches = []
        for i in range(num_batches):
            rng = np.random.default_rng([EVAL_SEED, i])
            batches.append(self._make(self._draw(rng)))
        return batches


def splits_info(source: str, split: str, train: TokenStream, val: TokenStream, tok) -> dict:
    """What a loaded corpus or token store reports about its two splits (train rows, run logs)."""
    return {
        "source": source,
        "split": split,
        "train_files": len(train.files),
        "val_files": len(val.files),
        "train_bytes": train.text_bytes,
        "val_bytes": val.text_bytes,
        "train_tokens": len(train),
        "val_tokens": len(val),
        "tokenizer": tok.describe(),
    }
