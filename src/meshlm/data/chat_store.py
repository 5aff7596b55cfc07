"""``meshlm data prepare --chat``: conversations to a packed token store with a loss mask.

Each record (JSONL, .jsonl.gz/.zst, Parquet or Arrow: ``messages``, or ``prompt`` and ``completion``)
is rendered with the chat template (``meshlm.data.chat``) into ids and a 0/1 loss mask, then ended by
the tokenizer's EOD (mask 0). Conversations are packed in order into rows of ``seq_len + 1`` tokens (a
row's inputs are its first ``seq_len``, its targets its last ``seq_len``): one goes into the current row
if it fits, else starts the next; a row's unused tail is EOD with mask 0 (with ``--doc-mask EOD`` the
attention stays inside each conversation). A conversation longer than a row is dropped
(``overlong="drop"``, the default: a cut answer teaches the model to stop mid-sentence) or cut to its
first ``seq_len + 1`` tokens (``"truncate"``; one whose cut keeps no trained token is dropped); both
are counted in the index and the summary. Rows split into train and validation by the sha1 of each
record (``records.row_is_val``), as ``data prepare`` splits one record file.

The store is a token store (``meshlm.data.store``) with, per split, a mask file (``train.mask``,
``val.mask``: one uint8 per token, CRC-32 in the index) and an index entry ``chat`` ({seq_len,
row_tokens, train_on, template_sha256, conversations, dropped, truncated, masked_tokens}).

This module must not import jax: it runs before the CLI has chosen the devices.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from pathlib import Path

import numpy as np

from meshlm.data.chat import ChatTemplate, conversation_problem, template_source
from meshlm.data.record_check import Problems
from meshlm.data.records import (
    ARROW_SUFFIXES,
    JSONL_SUFFIXES,
    _jsonl_stream,
    arrow_table,
    parse_line,
    read_errors,
    row_is_val,
    unreadable,
)
from meshlm.data.store import (
    FORMAT,
    SPLITS,
    TOKENIZER_JSON,
    store_dtype,
    tokenizer_entry,
    write_index,
    write_marker,
)
from meshlm.data.tokenizer import Tokenizer
from meshlm.data.tokenizer_files import directory_tokenizer
from meshlm.errors import DataError
from meshlm.ranges import STORE_SEQ_LEN

OVERLONG = ("drop", "truncate")


def read_records(path: Path, problems: Problems, kind: str = "--chat reads"):
    """(where, record) of each record of a JSONL, Parquet or Arrow file: where is ``FILE:LINE`` (JSONL)
    or ``FILE row N`` (``data.record_check``); a JSONL line may hold any JSON value (the caller checks
    it). A line that is not JSON is added to ``problems`` and reading goes on, so that every bad record
    is named; a file that cannot be read at all (a damaged .gz, a corrupt Parquet file) is one error
    naming it. ``kind`` begins the error for a file of another kind ("--chat reads")."""
    name = path.name.lower()
    if not name.endswith(JSONL_SUFFIXES + ARROW_SUFFIXES):
        raise DataError(f"{kind} .jsonl(.gz/.zst), .parquet or .arrow files of records, not {path}")
    try:
        if name.endswith(ARROW_SUFFIXES):
            yield from ((f"{path} row {i}", row) for i, row in enumerate(arrow_table(path).to_pylist()))
            return
        with open(path, "rb") as raw, _jsonl_stream(path, raw) as lines:
            for lineno, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                row, problem = parse_line(line)
                if problem is None:
                    yield f"{path}:{lineno}", row
                else:
                    problems.seen += 1
                    problems.add(f"{path}:{lineno}", f"{problem}; fix the line")
    except read_errors() as e:
        raise unreadable(path, e) from None


def read_conversations(paths, train_on: str) -> list[tuple[str, list[dict], bytes]]:
    """(where, messages, the record's sha1 key) of every record of ``paths``, all checked before any is
    tokenized: every bad record is found, and named in one error (``record_check.Problems``)."""
    problems, out = Problems("conversations"), []
    for path in map(Path, paths):
        for where, row in read_records(path, problems):
            problems.seen += 1
            messages, problem = conversation_problem(row, train_on)
            if problem is not None:
                problems.add(where, problem)
            elif not problems.found:  # the rest is only looked at, not kept
                out.append((where, messages, json.dumps(row, sort_keys=True).encode("utf-8")))
    problems.check()
    return out


class Packer:
    """Conversations packed into rows of ``row`` tokens (see the module doc), for one split."""

    def __init__(self, row: int, eod: int, overlong: str):
        self.row, self.eod, self.overlong = row, eod, overlong
        self.rows: list[tuple[np.ndarray, np.ndarray]] = []
        self.ids, self.mask = [], []  # the row being filled
        self.conversations = self.dropped = self.truncated = 0

    def add(self, ids: np.ndarray, mask: np.ndarray) -> None:
        ids, mask = np.append(ids, self.eod), np.append(mask, 0).astype(np.uint8)
        if len(ids) > self.row:
            if self.overlong == "drop" or not mask[: self.row].any():
                self.dropped += 1
                return
            ids, mask = ids[: self.row], mask[: self.row]
            self.truncated += 1
        if sum(map(len, self.ids)) + len(ids) > self.row:
            self.flush()
        self.ids.append(ids)
        self.mask.append(mask)
        self.conversations += 1

    def flush(self) -> None:
        if not self.ids:
            return
        ids, mask = np.concatenate(self.ids), np.concatenate(self.mask)
        pad = self.row - len(ids)
        self.rows.append((np.pad(ids, (0, pad), constant_values=self.eod), np.pad(mask, (0, pad))))
        self.ids, self.mask = [], []


def _write_split(out: Path, name: str, packer: Packer, dtype: np.dtype) -> dict:
    packer.flush()
    ids = np.concatenate([r[0] for r in packer.rows]) if packer.rows else np.zeros(0, np.int64)
    mask = np.concatenate([r[1] for r in packer.rows]) if packer.rows else np.zeros(0, np.uint8)
    data, mdata = ids.astype(dtype).tobytes(), mask.astype(np.uint8).tobytes()
    (out / f"{name}.tokens").write_bytes(data)
    (out / f"{name}.mask").write_bytes(mdata)
    return {
        "file": f"{name}.tokens",
        "tokens": len(ids),
        "bytes": len(ids),  # no text bytes: a chat store's bits per byte are not reported
        "crc32": f"{zlib.crc32(data):08x}",
        "mask_file": f"{name}.mask",
        "mask_crc32": f"{zlib.crc32(mdata):08x}",
        "masked_tokens": int(mask.sum()),
        "documents": [
            {"path": "conversations", "tokens": len(ids), "bytes": len(ids), "rows": len(packer.rows)}
        ],
        "conversations": packer.conversations,
        "dropped": packer.dropped,
        "truncated": packer.truncated,
    }


def load_template(tokenizer, template_file=None) -> ChatTemplate:
    """The chat template of ``tokenizer`` (a Tokenizer with the files it comes with, or a tokenizer
    directory: ``data.tokenizer_files.directory_tokenizer``), or ``template_file``, compiled on it (bad
    input fails here)."""
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else directory_tokenizer(tokenizer)
    if tok.kind != "hf":
        raise DataError("--chat needs a Hugging Face tokenizer directory (tokenizer.json), not bytes")
    text, specials = template_source(tok, template_file)
    return ChatTemplate(text, tok, specials)


def _nothing_to_train_on(paths, train: Packer, seq_len: int, records: int) -> DataError:
    """No trained token in the training split: every conversation longer than a row (then --overlong
    and --seq-len are the fix), or none in the split at all (too few records for the split)."""
    where = f"--data {' '.join(map(str, paths))}"
    if train.dropped:
        return DataError(
            f"{where}: no conversation left to train on: {train.dropped} of the training split's "
            f"{train.dropped + train.conversations} are longer than a row of {seq_len + 1} tokens and were "
            "dropped; pass a larger --seq-len, or --overlong truncate"
        )
    if train.conversations:
        return DataError(
            f"{where}: the training split's {train.conversations} conversations have no token to train on "
            "(see --train-on)"
        )
    return DataError(
        f"{where}: no conversation in the training split (its {records} records all hashed to "
        "validation); pass more records, or a smaller --val-fraction"
    )


def prepare_chat(
    paths,
    template: ChatTemplate,
    out: Path,
    *,
    seq_len: int,
    train_on="assistant",
    val_fraction=0.05,
    overlong="drop",
) -> dict:
    """Write the chat store into the (new or empty) directory ``out``; returns the index."""
    if overlong not in OVERLONG:
        raise DataError(f"--overlong {overlong!r}: choose one of {', '.join(OVERLONG)}")
    if problem := STORE_SEQ_LEN.problem("--seq-len", seq_len):  # library callers: the CLI checked it
        raise DataError(problem)
    tok = template.tok
    packers = {name: Packer(seq_len + 1, tok.eod_id, overlong) for name in SPLITS}
    problems = Problems("conversations")
    records = read_conversations(paths, train_on)  # every record checked before any is tokenized
    if not records:  # not "see --overlong": nothing was dropped, there was nothing
        raise DataError(
            f"--data {' '.join(map(str, paths))} holds no conversation (no record in it); pass files of "
            "conversations (`messages`, or `prompt` and `completion`)"
        )
    problems.seen = len(records)
    for where, messages, key in records:  # the template's own refusals, all found before any write
        try:
            ids, mask = template.encode(messages, train_on)
        except DataError as e:
            problems.add(where, str(e))
            continue
        packers["val" if row_is_val(key, val_fraction) else "train"].add(ids, mask)
    problems.check()
    out.mkdir(parents=True, exist_ok=True)
    write_marker(out)
    (out / TOKENIZER_JSON).write_text(tok.to_json(), encoding="utf-8")
    (out / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": tok.eod_token}) + "\n", encoding="utf-8"
    )
    dtype = store_dtype(tok.vocab_size)
    splits = {name: _write_split(out, name, packers[name], dtype) for name in SPLITS}
    if not splits["train"]["masked_tokens"]:
        raise _nothing_to_train_on(paths, packers["train"], seq_len, len(records))
    index = {
        "format": FORMAT,
        "tokenizer": tokenizer_entry(tok),
        "dtype": dtype.str,
        "source": f"{', '.join(map(str, paths))} (conversations)",
        "split": f"by record (sha1), about {val_fraction:.0%} validation",
        "val_fraction": val_fraction,
        "max_bytes": None,
        "text_field": "messages",
        "skipped_rows": {},
        "splits": splits,
        "chat": {
            "seq_len": seq_len,
            "row_tokens": seq_len + 1,
            "train_on": train_on,
            "overlong": overlong,
            "template_sha256": hashlib.sha256(template.text.encode("utf-8")).hexdigest(),
        },
    }
    write_index(out, index)
    return index
