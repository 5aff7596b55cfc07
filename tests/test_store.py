"""Token stores: ``meshlm data prepare`` tokenizes a corpus once (a process pool, a progress bar) into
memory-mapped token files the loader's split and tokens exactly; ``train --data DIR`` samples from the
map with resident memory far below the corpus; a damaged store or another tokenizer is a clear error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib

import numpy as np
import pytest
from helpers import meshlm_argv, run_cli

from meshlm.data.bpe import train_bpe
from meshlm.data.corpus import load_splits
from meshlm.data.store import (
    FORMAT,
    INDEX,
    open_store,
    store_arg,
    store_dtype,
    tokenizer_entry,
    write_index,
)
from meshlm.data.stream import Batcher
from meshlm.data.tokenizer import ByteTokenizer
from meshlm.data.tokenizer_files import load_tokenizer
from meshlm.errors import DataError

TEXT = "def add(a, b):\n    return a + b  # héllo wörld 日本語 🎉\n"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    for i in range(24):
        (root / f"m{i:02d}.py").write_text(TEXT * (i + 3) + f"x = {i}\n")
    return root


@pytest.fixture(scope="module")
def bpe_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_text(train_bpe([TEXT * 20, "import os\n" * 10], 300).to_json())
    return path


def _prepare(capsys, *args) -> None:
    assert run_cli("data", "prepare", *args) == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    assert "prepare" in err and "100%" in err  # the progress bar, on stderr


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_prepare_matches_the_loader(corpus, bpe_file, tmp_path, capsys, tokenizer):
    """Same split, same tokens, same batches as ``load_splits`` on the raw files; 2 worker processes."""
    spec = str(bpe_file) if tokenizer == "bpe" else "bytes"
    _prepare(
        capsys, "--data", str(corpus), "--tokenizer", spec, "--out", str(tmp_path / "s"), "--workers", "2"
    )
    tok = load_tokenizer(spec)
    store = open_store(tmp_path / "s")
    assert store.index["dtype"] == "<u2" and store.tokenizer == tokenizer_entry(tok)
    train, val, info = store.splits(tok, tok.vocab_size)
    want_train, want_val, want_info = load_splits([corpus], tokenizer=tok)
    for got, want in ((train, want_train), (val, want_val)):
        assert isinstance(got.tokens, np.memmap) and got.tokens.dtype == np.uint16
        np.testing.assert_array_equal(np.asarray(got.tokens), want.tokens)
        assert got.files == want.files and got.num_docs == want.num_docs and got.text_bytes == want.text_bytes
    assert {k: info[k] for k in want_info if k != "source"} == {
        k: v for k, v in want_info.items() if k != "source"
    }
    got, want = Batcher(train, 16, 4, seed=3), Batcher(want_train, 16, 4, seed=3)
    for step in (0, 7):
        full = got.batch(step)
        assert all(np.array_equal(full[k], want.batch(step)[k]) for k in full)
        half = got.batch(step, shard=1, num_shards=2)  # a process builds only its own rows
        assert all(np.array_equal(half[k], full[k][2:]) for k in full)
    if tokenizer == "bpe":
        assert load_tokenizer(tmp_path / "s" / "tokenizer.json").fingerprint == tok.fingerprint


def test_token_dtype():
    assert store_dtype(256) == store_dtype(2**16) == np.dtype("<u2")
    assert store_dtype(2**16 + 1) == store_dtype(152_064) == np.dtype("<u4")


def test_prepare_one_file_splits_by_bytes(corpus, tmp_path, capsys):
    one = corpus / "m05.py"
    _prepare(capsys, "--data", str(one), "--out", str(tmp_path / "s"), "--workers", "1", "--json")
    train, val, _ = open_store(tmp_path / "s").splits(ByteTokenizer(), 256)
    want_train, want_val, _ = load_splits([one])
    np.testing.assert_array_equal(np.asarray(train.tokens), want_train.tokens)
    np.testing.assert_array_equal(np.asarray(val.tokens), want_val.tokens)


def test_bad_inputs_fail_before_any_work(corpus, tmp_path, capsys):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert run_cli("data", "prepare", "--data", str(corpus), "--out", str(tmp_path / "full")) == 2
    assert "not an empty directory" in capsys.readouterr().err
    assert (
        run_cli("data", "prepare", "--tokenizer", str(tmp_path / "nope.json"), "--out", str(tmp_path / "o"))
        == 2
    )
    assert "no such file" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.fixture
def store(corpus, tmp_path, capsys):
    _prepare(capsys, "--data", str(corpus), "--out", str(tmp_path / "s"), "--workers", "1")
    return tmp_path / "s"


def test_damaged_store_is_refused(store):
    index = json.loads((store / INDEX).read_text())
    tokens = store / "train.tokens"
    data = bytearray(tokens.read_bytes())
    data[101] ^= 1
    tokens.write_bytes(data)
    with pytest.raises(DataError, match="damaged: train.tokens does not match its CRC-32"):
        open_store(store)
    tokens.write_bytes(data[:-2])
    with pytest.raises(DataError, match="damaged: train.tokens has .* bytes, the index says"):
        open_store(store)
    index["splits"]["val"]["tokens"] += 1  # an edited index
    (store / INDEX).write_text(json.dumps(index))
    with pytest.raises(DataError, match="does not match its own SHA-256"):
        open_store(store)
    (store / INDEX).write_text("{not json")
    with pytest.raises(DataError, match="not readable JSON"):
        open_store(store)
    (store / INDEX).unlink()
    with pytest.raises(DataError, match="incomplete token store"):  # never read as raw text
        store_arg([store])
    with pytest.raises(DataError, match="incomplete token store"):
        open_store(store)


def test_store_of_another_tokenizer_is_refused(store, bpe_file, tmp_path, capsys):
    bpe = load_tokenizer(bpe_file)
    with pytest.raises(DataError, match="made with another tokenizer"):
        open_store(store).splits(bpe, 512)
    with pytest.raises(DataError, match="holds ids up to 255 .* but the model has vocab_size=64"):
        open_store(store).splits(ByteTokenizer(), 64)
    with pytest.raises(DataError, match="pass it alone"):
        store_arg([store, bpe_file])
    argv = [
        "train",
        "--config",
        "tiny-lm",
        "--data",
        str(store),
        "--out",
        str(tmp_path / "run"),
        "--mesh",
        "1x1",
    ]
    assert run_cli(*argv, "--tokenizer", str(bpe_file)) == 2
    assert "made with another tokenizer" in capsys.readouterr().err
    assert run_cli(*argv, "--tokenizer", "bpe-300") == 2
    assert "already tokenized" in capsys.readouterr().err


def _write_big_store(directory, n_tokens: int) -> int:
    """A byte-tokenizer store of ``n_tokens`` uint16 tokens, written directly: mostly a sparse file
    (zeros are EOD) with real text at both ends. Returns its size in bytes."""
    directory.mkdir()
    path = directory / "train.tokens"
    text = np.frombuffer((TEXT * 40000).encode(), np.uint8).astype("<u2")
    with open(path, "wb") as f:
        f.write(text.tobytes())
        f.truncate(2 * n_tokens - text.nbytes)
        f.seek(0, os.SEEK_END)
        f.write(text.tobytes())
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(16 * 2**20):
            crc = zlib.crc32(chunk, crc)
    (directory / "val.tokens").write_bytes(text.tobytes())
    split = lambda file, n, c: {
        "file": file,
        "tokens": n,
        "bytes": n,
        "crc32": c,
        "documents": [{"path": file}],
    }
    val_crc = f"{zlib.crc32(text.tobytes()):08x}"
    index = {
        "format": FORMAT,
        "tokenizer": tokenizer_entry(ByteTokenizer()),
        "dtype": "<u2",
        "source": "generated",
        "split": "generated",
        "splits": {
            "train": split("train.tokens", n_tokens, f"{crc:08x}"),
            "val": split("val.tokens", len(text), val_crc),
        },
    }
    write_index(directory, index)
    return 2 * n_tokens


# slow: a memory bound over a long run (its cost is its scale); the store's batches equal the loader's quick
# above
@pytest.mark.slow
def test_training_memory_does_not_grow_with_the_corpus(tmp_path):
    """A 3 GiB store trains (a subprocess, the real CLI) with a peak resident set under half its size:
    the corpus is mapped, never read into memory (it would be 3 GiB resident, plus an int32 copy)."""
    size = _write_big_store(tmp_path / "big", 3 * 2**29)
    argv = meshlm_argv(
        "train", "--config", "tiny-lm", "--data", str(tmp_path / "big"), "--out", str(tmp_path / "run"),
        "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--eval-batches", "1", "--sample-tokens", "0",
        "--devices", "1", "--mesh", "1x1", "--json",
    )  # fmt: skip
    # A child that runs the training and reports its own children's peak RSS (its only child: train).
    probe = "import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
    probe += "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    out = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=600)
    code, peak_kib = map(int, out.stdout.strip().splitlines()[-1].split())
    assert code == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout.strip().splitlines()[-2])
    assert summary["step"] == 2 and summary["val_bpb_end"] > 0
    assert peak_kib * 1024 < size / 2, (
        f"peak RSS {peak_kib / 2**20:.2f} GiB for a {size / 2**30:.0f} GiB store"
    )


def test_train_on_a_bpe_store(corpus, bpe_file, tmp_path, capsys):
    """The model's tokenizer is the store's (its copy in the store): trains on mp = 2, the 300-id
    vocabulary padded to 384 rows; val_bpb is per byte."""
    store = str(tmp_path / "s")
    _prepare(capsys, "--data", str(corpus), "--tokenizer", str(bpe_file), "--out", store, "--workers", "1")
    argv = ["train", "--config", "tiny-lm", "--data", store, "--tokenizer", f"{store}/tokenizer.json"]
    argv += ["--out", str(tmp_path / "run"), "--mesh", "1x2", "--steps", "1", "--batch-size", "2"]
    argv += ["--seq-len", "16", "--eval-batches", "1", "--sample-tokens", "0", "--json"]
    assert run_cli(*argv) == 0, capsys.readouterr().err
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["step"] == 1 and 0 < summary["val_bpb_end"] < 20
