"""Record files: corpora stored as rows with a text field, read in bounded batches.

Formats, by file name: ``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst`` (one JSON object a line), ``.parquet``
and ``.arrow`` (Arrow IPC, as ``datasets``' ``save_to_disk`` writes its shards). A directory that
``save_to_disk`` wrote (``state.json`` and ``dataset_info.json`` beside ``data-*.arrow``) is read as its
arrow shards, in ``state.json``'s order, with pyarrow: the ``datasets`` package is not needed.

Each row is one document: its ``field`` (``--text-field``, default ``text``), as UTF-8 with NUL
characters dropped (NUL is the byte tokenizer's end-of-document). A field missing from the schema
(Parquet, Arrow) or from a JSONL file's first row is an error naming the file and the fields it has;
a later row whose field is absent, null or not a string is skipped and counted by kind (``Skipped``),
never dropped silently. Rows are read ``BATCH_ROWS`` lines, or one Parquet row-group batch, at a
time: memory is bounded by a batch, not by the file.

Split of one record file: a row is validation iff the sha1 of its document bytes, mod 1000, is below
``val_fraction * 1000`` (``row_is_val``): identical documents always land on the same side.

This module must not import jax: it runs before the CLI has chosen the devices.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from meshlm.errors import DataError

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
ARROW_SUFFIXES = (".parquet", ".arrow")
RECORD_SUFFIXES = JSONL_SUFFIXES + ARROW_SUFFIXES
BATCH_ROWS = 1024  # rows per batch read (and per piece of work in `data prepare`)
DEFAULT_FIELD = "text"
DATASET_FILES = ("state.json", "dataset_info.json")  # what marks a `save_to_disk` directory


class Skipped(Counter):
    """Rows without a string text field, by kind ("null", "int", "missing", ...)."""

    def describe(self, field: str) -> str:
        kinds = ", ".join(f"{kind}: {n:,}" for kind, n in sorted(self.items()))
        return f"skipped {sum(self.values()):,} rows whose {field!r} is not a string ({kinds})"


def is_record_file(path: str | Path) -> bool:
    return str(path).lower().endswith(RECORD_SUFFIXES)


def is_saved_dataset(directory: str | Path) -> bool:
    """Whether ``directory`` is what ``datasets``' ``save_to_disk`` wrote (or a DatasetDict of them)."""
    d = Path(directory)
    return all((d / n).is_file() for n in DATASET_FILES) or (d / "dataset_dict.json").is_file()


def dataset_files(directory: str | Path) -> list[Path]:
    """The arrow shards of a ``save_to_disk`` directory, in its ``state.json`` order."""
    d = Path(directory)
    if (d / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in d.iterdir() if p.is_dir() and is_saved_dataset(p))
        raise DataError(
            f"{d} is a saved DatasetDict (splits: {', '.join(splits) or 'none'}); pass one split's "
            f"directory, e.g. {d / (splits[0] if splits else 'train')}"
        )
    try:
        names = [f["filename"] for f in json.loads((d / "state.json").read_text("utf-8"))["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(
            f"{d / 'state.json'} is not a readable datasets state ({type(e).__name__}: {e}); "
            "save the dataset again with save_to_disk"
        ) from None
    files = [d / str(n) for n in names]
    for f in files:
        if Path(str(f.name)).name != f.name or f.parent != d or not f.is_file():
            raise DataError(f"{d / 'state.json'} names {f.name!r}, which is not a file in {d}")
    if not files:
        raise DataError(f"saved dataset {d} holds no data files; save the dataset again")
    return files


def to_document(text: str) -> bytes:
    """A row's text as document bytes: UTF-8 (lone surrogates replaced), NULs dropped."""
    return text.encode("utf-8", errors="replace").replace(b"\0", b"")


def row_is_val(doc: bytes, val_fraction: float) -> bool:
    """The row split of one record file: sha1 of the document bytes, mod 1000 (see the module doc)."""
    h = int.from_bytes(hashlib.sha1(b"row:" + doc).digest()[:8], "big")
    return h % 1000 < val_fraction * 1000


ROW_SPLIT = "one record file: rows by sha1 of their text, about {:.0%} validation"


def one_sided(path: Path, n_train: int, n_val: int, val_fraction: float) -> DataError:
    """One record file whose rows all hashed to one side: too few rows for this fraction."""
    empty = "validation" if not n_val else "training"
    return DataError(
        f"the {empty} split of {path} is empty: all {n_train + n_val:,} rows hashed to the other side "
        f"at val_fraction {val_fraction}; pass more rows or another --val-fraction"
    )


# --- reading -------------------------------------------------------------------------------------


def _missing(path: Path, field: str, fields) -> DataError:
    have = ", ".join(map(str, fields)) or "none"
    return DataError(
        f"data file {path} has no field {field!r} (its fields: {have}); pass --text-field with one of them"
    )


def unreadable(path: Path, e: Exception) -> DataError:
    """A record file that cannot be read (a damaged or truncated .gz/.zst, a corrupt Parquet or Arrow
    file), named in one line."""
    why = " ".join(str(e).split()) or type(e).__name__
    return DataError(f"cannot read data file {path} ({why}); fix it or leave it out of the paths")


def parse_line(line: bytes) -> tuple[object, str | None]:
    """(the JSON value of one JSONL line, None), or (None, what is wrong with it): not JSON, or nested
    deeper than the parser's recursion limit (a RecursionError, never a traceback)."""
    try:
        return json.loads(line), None
    except ValueError as e:
        return None, f"not JSON ({e})"
    except RecursionError:
        return None, "not JSON that can be read (nested deeper than Python's recursion limit)"


def read_errors() -> tuple[type[BaseException], ...]:
    """What reading a damaged record file raises: OSError (gzip's BadGzipFile too), a truncated
    stream's EOFError, zstandard's and pyarrow's errors."""
    import pyarrow as pa
    import zstandard

    return (OSError, EOFError, zstandard.ZstdError, pa.ArrowException)


def _jsonl_stream(path: Path, raw):
    name = path.name.lower()
    if name.endswith(".gz"):
        import gzip

        return gzip.GzipFile(fileobj=raw)
    if name.endswith(".zst"):
        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw))
    return raw


def _jsonl_rows(path: Path, field: str, skipped: Skipped) -> Iterator[tuple[list[bytes], int]]:
    """(documents, compressed bytes read so far) per batch of lines."""
    batch, first = [], True
    with open(path, "rb") as raw, _jsonl_stream(path, raw) as lines:
        try:
            for lineno, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                row, problem = parse_line(line)
                if problem is not None:
                    raise DataError(
                        f"data file {path} line {lineno} is {problem}; fix it or leave the file out"
                    )
                value = row.get(field, _MISSING) if isinstance(row, dict) else _MISSING
                if first and value is _MISSING:  # the first row sets the schema: a wrong --text-field
                    raise _missing(path, field, row.keys() if isinstance(row, dict) else ())
                first = False
                _take(value, batch, skipped)
                if len(batch) >= BATCH_ROWS:
                    yield batch, raw.tell()
                    batch = []
        except read_errors() as e:
            raise unreadable(path, e) from None
        yield batch, raw.tell()


_MISSING = object()
_JSON_KINDS = {type(None): "null", bool: "bool", int: "int", float: "float", list: "list", dict: "object"}


def _take(value, batch: list[bytes], skipped: Skipped) -> None:
    if isinstance(value, str):
        batch.append(to_document(value))
    else:
        skipped["missing" if value is _MISSING else _JSON_KINDS.get(type(value), "other")] += 1


def _check_column(path: Path, schema, field: str) -> None:
    import pyarrow as pa

    if field not in schema.names:
        raise _missing(path, field, schema.names)
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise DataError(
            f"field {field!r} of data file {path} holds {kind}, not text; pass --text-field naming a "
            "string column"
        )


def _arrow_batches(path: Path, field: str):
    """(schema check done) record batches of ``field`` and a callable: bytes of the file read so far."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if path.name.lower().endswith(".parquet"):
        pf = pq.ParquetFile(path)
        _check_column(path, pf.schema_arrow, field)
        size, rows = path.stat().st_size, max(1, pf.metadata.num_rows)
        done = [0]

        def batches():
            for b in pf.iter_batches(batch_size=BATCH_ROWS, columns=[field]):
                done[0] += b.num_rows
                yield b

        return batches(), lambda: size * done[0] // rows
    source = pa.memory_map(str(path))
    try:
        reader = pa.ipc.open_stream(source)
        _check_column(path, reader.schema, field)
        return iter(reader), source.tell
    except pa.ArrowInvalid:  # the Arrow IPC file format, not the stream format
        source.seek(0)
        reader = pa.ipc.open_file(source)
        _check_column(path, reader.schema, field)
        return (reader.get_batch(i) for i in range(reader.num_record_batches)), source.tell


def arrow_table(path: Path):
    """The whole table of a Parquet file, or of an Arrow IPC file (stream or file format, as
    ``save_to_disk`` writes its shards): by the file name, as ``_arrow_batches`` reads them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if path.name.lower().endswith(".parquet"):
        return pq.read_table(path)
    with pa.memory_map(str(path)) as source:
        try:
            return pa.ipc.open_stream(source).read_all()
        except pa.ArrowInvalid:  # the Arrow IPC file format, not the stream format
            source.seek(0)
            return pa.ipc.open_file(source).read_all()


def _arrow_rows(path: Path, field: str, skipped: Skipped) -> Iterator[tuple[list[bytes], int]]:
    import pyarrow as pa

    try:
        batches, position = _arrow_batches(path, field)
        for b in batches:
            values = b.column(field).to_pylist()
            docs = [to_document(v) for v in values if v is not None]
            if len(docs) < len(values):
                skipped["null"] += len(values) - len(docs)
            yield docs, position()
    except (OSError, pa.ArrowException) as e:
        raise unreadable(path, e) from None


def read_rows(path: Path, field: str = DEFAULT_FIELD, skipped: Skipped | None = None):
    """Batches of (documents, bytes of the file read so far) of a record file; non-string rows are
    counted in ``skipped``. The last batch reports the whole file read."""
    skipped = Skipped() if skipped is None else skipped
    rows = _jsonl_rows if path.name.lower().endswith(JSONL_SUFFIXES) else _arrow_rows
    size = path.stat().st_size
    for docs, position in rows(path, field, skipped):
        yield docs, min(position, size)
    yield [], size


def check_file(path: Path, field: str = DEFAULT_FIELD) -> None:
    """Fail now on a record file that cannot be read or lacks ``field``: its schema (Parquet, Arrow)
    or its first batch of lines (JSONL)."""
    next(read_rows(path, field))


def documents(path: Path, field: str = DEFAULT_FIELD, skipped: Skipped | None = None) -> Iterator[bytes]:
    """Every document of a record file, in row order."""
    for docs, _ in read_rows(path, field, skipped):
        yield from docs
