"""Record corpora: JSONL (plain, gzip, zstd), Parquet (a file, a directory of shards, a glob) and a
``datasets`` ``save_to_disk`` directory, read a batch at a time. ``data prepare`` writes the loader's
tokens exactly; a missing field is one line naming the file and its fields; rows without a string
text are counted and reported; one record file splits by a hash of each row's text."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from helpers import meshlm_argv, run_cli

from meshlm.data.corpus import load_splits
from meshlm.data.records import BATCH_ROWS, Skipped, documents, row_is_val
from meshlm.data.store import open_store
from meshlm.data.tokenizer import ByteTokenizer
from meshlm.errors import DataError

WORDS = "the mesh splits heads over mp and the batch over dp; ünïcode 日本 🎉 ".split()


def _texts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(3, 40)))) + f" #{i}" for i in range(n)]


def _rows(n: int, seed: int = 0) -> list[dict]:
    """Rows with ``content``; a few are null, a number or lack the field (kept out, counted)."""
    rows = [{"id": i, "content": t, "lang": "en"} for i, t in enumerate(_texts(n, seed))]
    rows[3]["content"], rows[7]["content"] = None, 42
    del rows[11]["content"]
    return rows


def _write_jsonl(path, rows) -> None:
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()
    if path.name.endswith(".gz"):
        data = gzip.compress(data)
    elif path.name.endswith(".zst"):
        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)


def _table(rows) -> pa.Table:
    content = [r.get("content") if isinstance(r.get("content"), str) else None for r in rows]
    return pa.table({"id": [r["id"] for r in rows], "content": pa.array(content, pa.string())})


def _save_to_disk(directory, rows, shards: int) -> None:
    """A ``save_to_disk`` directory: with ``datasets`` when installed, else its layout, via pyarrow."""
    try:
        import datasets
    except ImportError:
        datasets = None
    if datasets is not None:
        datasets.Dataset(_table(rows)).save_to_disk(str(directory), num_shards=shards)
        return
    directory.mkdir()
    names = [f"data-{k:05d}-of-{shards:05d}.arrow" for k in range(shards)]
    for k, name in enumerate(names):
        with (
            pa.OSFile(str(directory / name), "wb") as sink,
            pa.ipc.new_stream(sink, _table(rows).schema) as w,
        ):
            w.write_table(_table(rows[k::shards]))
    (directory / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names]}))
    (directory / "dataset_info.json").write_text("{}")


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Each layout of the same kind of rows: name -> the --data argument."""
    root = tmp_path_factory.mktemp("records")
    out = {}
    for suffix in (".jsonl", ".jsonl.gz", ".jsonl.zst"):
        _write_jsonl(root / f"one{suffix}", _rows(300))
        out[suffix] = str(root / f"one{suffix}")
    (root / "shards").mkdir()
    for k in range(6):
        pq.write_table(_table(_rows(40, seed=k)), root / "shards" / f"part-{k}.parquet", row_group_size=7)
    out["parquet glob"] = str(root / "shards" / "*.parquet")
    out["parquet dir"] = str(root / "shards")
    out["parquet file"] = str(root / "shards" / "part-0.parquet")
    _save_to_disk(root / "saved", _rows(200), shards=3)
    out["save_to_disk"] = str(root / "saved")
    _save_to_disk(root / "saved1", _rows(200), shards=1)
    out["save_to_disk, one shard"] = str(root / "saved1")
    return out


def _prepare(capsys, *args) -> dict:
    assert run_cli("data", "prepare", *args, "--json") == 0, capsys.readouterr().err
    captured = capsys.readouterr()
    assert "100%" in captured.err  # the progress bar reached the end
    return json.loads(captured.out.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "name",
    [".jsonl", ".jsonl.gz", ".jsonl.zst", "parquet glob", "parquet dir", "parquet file", "save_to_disk"]
    + ["save_to_disk, one shard"],
)
def test_prepare_matches_the_loader(corpora, tmp_path, capsys, name):
    """The store holds the loader's tokens, documents and files, split the same way; skipped rows counted."""
    data = corpora[name]
    summary = _prepare(capsys, "--data", data, "--text-field", "content", "--out", str(tmp_path / "s"))
    store = open_store(tmp_path / "s")
    train, val, got_info = store.splits(ByteTokenizer(), 256)
    want_train, want_val, info = load_splits([data], text_field="content")
    assert {k: v for k, v in got_info.items() if k != "source"} == {
        k: v for k, v in info.items() if k != "source"
    }
    for got, want in ((train, want_train), (val, want_val)):
        np.testing.assert_array_equal(np.asarray(got.tokens), want.tokens)
        assert got.files == want.files and got.num_docs == want.num_docs and got.text_bytes == want.text_bytes
        assert got.num_docs > 0
    one_file = name.startswith(".jsonl") or name in ("parquet file", "save_to_disk, one shard")
    assert store.index["split"].startswith("one record file" if one_file else "by file")
    skipped = {"null": 1, "int": 1, "missing": 1} if name.startswith(".jsonl") else None
    if skipped:
        assert summary["skipped_rows"] == skipped and "skipped 3 rows whose 'content'" in info["skipped"]
    else:  # Arrow: a null, or a non-string turned null, per 40- or 200-row table
        assert set(summary["skipped_rows"]) == {"null"} and summary["skipped_rows"]["null"] > 0
    assert summary["train_documents"] + summary["val_documents"] == train.num_docs + val.num_docs


def test_rows_and_their_order(corpora):
    """Each row is one document, UTF-8, in file order; the non-string rows are counted by kind."""
    skipped = Skipped()
    docs = list(documents(Path(corpora[".jsonl.zst"]), "content", skipped))
    want = [t for i, t in enumerate(_texts(300)) if i not in (3, 7, 11)]
    assert [d.decode() for d in docs] == want
    assert skipped == {"null": 1, "int": 1, "missing": 1}


def test_one_file_splits_by_row_hash(tmp_path):
    """Validation iff the hash of the row's text is below val_fraction: duplicates stay together, and
    the same row lands on the same side whatever else is in the file."""
    texts = _texts(400)
    texts[50:60] = [texts[49]] * 10
    _write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in texts])
    train, val, info = load_splits([tmp_path / "a.jsonl"], val_fraction=0.2)
    want_val = [t for t in texts if row_is_val(t.encode(), 0.2)]
    got_val = bytes(val.tokens).split(b"\0")[:-1]
    assert [d.decode() for d in got_val] == want_val and 40 < len(want_val) < 120
    assert train.num_docs + val.num_docs == 400 and "rows by sha1" in info["split"]
    _write_jsonl(tmp_path / "b.jsonl", [{"text": t} for t in reversed(texts[:200])])
    _, val_b, _ = load_splits([tmp_path / "b.jsonl"], val_fraction=0.2)
    assert set(bytes(val_b.tokens).split(b"\0")[:-1]) <= set(got_val)


def test_too_few_rows_for_a_split(tmp_path, capsys):
    _write_jsonl(tmp_path / "two.jsonl", [{"text": "a"}, {"text": "b"}])
    with pytest.raises(DataError, match="validation split of .*two.jsonl is empty: all 2 rows"):
        load_splits([tmp_path / "two.jsonl"])
    assert (
        run_cli("data", "prepare", "--data", str(tmp_path / "two.jsonl"), "--out", str(tmp_path / "s")) == 2
    )
    assert "validation split" in capsys.readouterr().err
    assert not (tmp_path / "s" / "index.json").exists()  # no loadable store


def test_missing_field_names_the_file_and_its_fields(corpora, tmp_path, capsys):
    for data in (corpora[".jsonl.gz"], corpora["parquet glob"], corpora["save_to_disk"]):
        assert run_cli("data", "prepare", "--data", data, "--out", str(tmp_path / "s")) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "has no field 'text' (its fields: id, " in err, err
        assert "--text-field" in err and not (tmp_path / "s").exists()  # before any work
    with pytest.raises(DataError, match="field 'id' of data file .* holds int64, not text"):
        load_splits([corpora["parquet dir"]], text_field="id")


def test_bad_files_are_one_line(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(DataError, match="bad.jsonl line 2 is not JSON"):
        load_splits([tmp_path / "bad.jsonl"])
    (tmp_path / "bad.jsonl.gz").write_bytes(b"not gzip at all")
    with pytest.raises(DataError, match="cannot read data file .*bad.jsonl.gz"):
        load_splits([tmp_path / "bad.jsonl.gz"])
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 but not really")
    with pytest.raises(DataError, match="cannot read data file .*bad.parquet"):
        load_splits([tmp_path / "bad.parquet"])


def test_a_saved_dataset_dict_names_its_splits(tmp_path):
    (tmp_path / "dd").mkdir()
    _save_to_disk(tmp_path / "dd" / "train", _rows(20), shards=1)
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["train"]}')
    with pytest.raises(DataError, match="saved DatasetDict .splits: train.; pass one split's directory"):
        load_splits([tmp_path / "dd"])


def test_big_parquet_shards_are_not_skipped_in_directories(tmp_path, monkeypatch):
    """The 50 MB limit for files found in directories is for text; record files are read in batches."""
    from meshlm.data import sources

    pq.write_table(_table(_rows(40)), tmp_path / "a.parquet")
    pq.write_table(_table(_rows(40, seed=1)), tmp_path / "b.parquet")
    monkeypatch.setattr(sources, "MAX_FILE_BYTES", 10)
    assert [p.name for p in sources.resolve_files([tmp_path])] == ["a.parquet", "b.parquet"]


def _prepare_peak_rss(tmp_path, n_batches):
    """``data prepare`` of ``n_batches`` batches of 4 kB rows as JSONL.zst, in a child process: its
    peak resident set (bytes) and the text's size (bytes, one EOD a row)."""
    text, size, path = "x" * 4000, 0, tmp_path / f"big{n_batches}.jsonl.zst"
    with open(path, "wb") as f, zstandard.ZstdCompressor(level=1).stream_writer(f) as w:
        for start in range(0, n_batches * BATCH_ROWS, BATCH_ROWS):  # distinct rows: the row hash splits them
            docs = [f"{i} {text}" for i in range(start, start + BATCH_ROWS)]
            w.write("".join(json.dumps({"text": d}) + "\n" for d in docs).encode())
            size += sum(len(d) + 1 for d in docs)
    argv = meshlm_argv("data", "prepare", "--data", str(path), "--workers", "1")
    argv += ["--out", str(tmp_path / f"s{n_batches}"), "--json"]
    probe = "import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
    probe += "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    out = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=600)
    code, peak_kib = map(int, out.stdout.strip().splitlines()[-1].split())
    assert code == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout.strip().splitlines()[-2])
    assert summary["train_tokens"] + summary["val_tokens"] == size
    return peak_kib * 1024, size


# slow: a soak (its cost is its scale: a 400 MB file prepared); the same streaming code path on small
# files is quick (test_prepare_matches_the_loader)
@pytest.mark.slow
def test_prepare_memory_does_not_grow_with_the_file(tmp_path):
    """``data prepare`` of a 400 MB (decompressed) JSONL.zst peaks at the resident set of a 40 MB one:
    the text is read and tokenized a batch of rows at a time. (The growth is what is pinned, not the
    total: the interpreter and its imports are ~100 MiB on one machine and ~150 on another.)"""
    small_peak, small_size = _prepare_peak_rss(tmp_path, 10)
    big_peak, big_size = _prepare_peak_rss(tmp_path, 100)
    # measured: +0.3 MiB for +352 MB of text; a reader that kept the text would grow by more than it
    assert big_peak - small_peak < (big_size - small_size) / 20, (
        f"peak RSS {small_peak / 2**20:.0f} MiB for {small_size / 2**20:.0f} MB of text, "
        f"{big_peak / 2**20:.0f} MiB for {big_size / 2**20:.0f} MB"
    )


@pytest.mark.parametrize("via", ["store", "raw"])
def test_train_on_records(corpora, tmp_path, capsys, via):
    """``data prepare --data 'shards/*.parquet' --text-field content`` then ``train --data STORE``; and
    ``train --data x.jsonl.gz --text-field content`` straight from the rows, skipped rows reported."""
    if via == "store":
        _prepare(
            capsys, "--data", corpora["parquet glob"], "--text-field", "content", "--out", str(tmp_path / "s")
        )
        data = [str(tmp_path / "s")]
    else:
        data = [corpora[".jsonl.gz"], "--text-field", "content"]
    argv = ["train", "--config", "tiny-lm", "--data", *data, "--out", str(tmp_path / "run"), "--mesh", "1x2"]
    argv += [
        "--steps",
        "1",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--eval-batches",
        "1",
        "--sample-tokens",
        "0",
    ]
    assert run_cli(*argv, "--json") == 0, capsys.readouterr().err
    captured = capsys.readouterr()
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary["step"] == 1 and 0 < summary["val_bpb_end"] < 20
    assert "skipped" in captured.err and "whose 'content' is not a string" in captured.err


def test_tokenizer_train_on_rows(corpora, tmp_path, capsys):
    """``meshlm tokenizer train`` reads record files' rows too (one document each)."""
    argv = ["tokenizer", "train", "--data", corpora["parquet glob"], "--text-field", "content"]
    assert run_cli(*argv, "--vocab-size", "300", "--out", str(tmp_path / "t.json"), "--json") == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    texts = [t for k in range(6) for i, t in enumerate(_texts(40, k)) if i not in (3, 7, 11)]  # 3 null
    assert summary["documents"] == len(texts) and summary["bytes"] == sum(len(t.encode()) for t in texts)
