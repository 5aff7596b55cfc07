"""meshlm.data: byte tokenizer, sources, split by file, and stateless, shardable batches."""

from __future__ import annotations

import ast
import importlib
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from meshlm.data import sources, tokenizer
from meshlm.data.corpus import load_splits
from meshlm.data.stream import Batcher, TokenStream
from meshlm.data.tokenizer import EOD, bits_per_byte, decode, encode
from meshlm.errors import DataError


def _write_corpus(root: Path, n: int = 20) -> list[Path]:
    """``n`` files whose contents are unique, so each one can be found in a stream."""
    paths = []
    for i in range(n):
        path = root / f"sub{i % 3}" / f"doc{i:02d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"<document {i:02d}> " + "lorem ipsum dolor " * (5 + i) + f"</{i:02d}>")
        paths.append(path)
    return paths


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    _write_corpus(tmp_path / "corpus")
    return tmp_path / "corpus"


@pytest.fixture
def stream() -> TokenStream:
    rng = np.random.default_rng(0)
    return TokenStream(rng.integers(0, 256, size=5000))


# --- tokenizer ---------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "hello, world\n", "héllo wörld ✓ 日本語 🚀 Ω≈ç"])
def test_encode_decode_round_trip(text: str) -> None:
    ids = encode(text)
    assert ids.dtype == np.int32
    assert ids.tolist() == list(text.encode("utf-8"))
    assert decode(ids) == text
    assert decode(ids.tolist()) == text


def test_decode_never_raises() -> None:
    assert decode([0xFF, ord("A")]) == "\ufffdA"  # invalid UTF-8
    assert decode(encode("é")[:1]) == "\ufffd"  # a cut multi-byte character
    assert decode([ord("a"), 300, -1, ord("b")]) == "a\ufffd\ufffdb"  # outside the vocabulary
    assert decode(np.zeros((0,), np.int32)) == ""


def test_encode_drops_nul_so_eod_is_unambiguous() -> None:
    assert encode("a\0b").tolist() == [ord("a"), ord("b")]
    assert EOD == 0 and tokenizer.VOCAB_SIZE == 256


def test_bits_per_byte() -> None:
    assert bits_per_byte(math.log(2)) == pytest.approx(1.0)
    assert bits_per_byte(0.0) == 0.0


# --- streams and EOD ---------------------------------------------------------------------------


def test_documents_end_with_eod_and_nul_bytes_are_dropped(tmp_path: Path) -> None:
    tokens = TokenStream.from_documents([b"ab", b"c\0d"]).tokens
    assert tokens.tolist() == [97, 98, EOD, 99, 100, EOD]
    a, b = tmp_path / "a.txt", tmp_path / "b.bin"
    a.write_bytes(b"first\0file")
    b.write_bytes(b"second")
    stream = TokenStream.from_files([a, b])
    assert decode(stream.tokens).split("\0") == ["firstfile", "second", ""]
    assert stream.num_docs == 2


def test_stream_rejects_out_of_vocabulary_ids() -> None:
    with pytest.raises(DataError, match="256"):
        TokenStream(np.array([1, 256]))


# --- sources and split -------------------------------------------------------------------------


def test_default_corpus_is_the_stdlib_subset() -> None:
    train, val, info = load_splits(None)
    assert len(train) > 100_000 and len(val) > 1000
    assert info["train_files"] >= 1 and info["val_files"] >= 1
    assert not set(train.files) & set(val.files)  # disjoint by file
    assert info["train_bytes"] + info["val_bytes"] <= sources.DEFAULT_MAX_BYTES + len(train.files) * 2
    assert all(f.suffix == ".py" for f in train.files + val.files)
    assert not any("site-packages" in f.parts for f in train.files + val.files)
    assert "standard library" in info["source"]


def test_default_cap_is_a_parameter_and_deterministic() -> None:
    small = sources.resolve_files(None, max_bytes=200_000)
    assert small == sources.resolve_files(None, max_bytes=200_000)
    assert sum(f.stat().st_size for f in small) <= 200_000
    assert small == sorted(set(small))


def test_split_is_deterministic_and_by_file(corpus: Path) -> None:
    train, val, info = load_splits([str(corpus)], val_fraction=0.3)
    again = load_splits([str(corpus)], val_fraction=0.3)
    assert np.array_equal(train.tokens, again[0].tokens)
    assert np.array_equal(val.tokens, again[1].tokens)
    assert info == again[2]
    assert train.files and val.files and not set(train.files) & set(val.files)
    assert len(train.files) + len(val.files) == 20
    # Every file's text lies whole in exactly one split, as its own document.
    train_docs, val_docs = (set(decode(s.tokens).split("\0")) for s in (train, val))
    for path in sorted(corpus.rglob("*.txt")):
        text = path.read_text()
        assert (text in train_docs) != (text in val_docs)
        assert (text in train_docs) == (path in train.files)


def test_split_uses_relative_paths(corpus: Path, tmp_path: Path) -> None:
    # The same corpus in another place, named in another order, splits the same way.
    moved = tmp_path / "elsewhere" / "copy"
    shutil.copytree(corpus, moved)
    a = load_splits([str(corpus)], val_fraction=0.3)
    b = load_splits([str(moved / "sub2"), str(moved / "sub0"), str(moved)], val_fraction=0.3)
    assert [f.relative_to(corpus) for f in a[1].files] == [f.relative_to(moved) for f in b[1].files]


@pytest.mark.parametrize("fraction", [0.001, 0.999])
def test_both_splits_non_empty_with_two_files(tmp_path: Path, fraction: float) -> None:
    paths = _write_corpus(tmp_path, n=2)
    train, val, info = load_splits([str(p) for p in paths], val_fraction=fraction)
    assert (info["train_files"], info["val_files"]) == (1, 1)
    assert set(train.files) | set(val.files) == set(paths)


def test_single_file_is_split_by_bytes(tmp_path: Path) -> None:
    path = tmp_path / "one.txt"
    path.write_bytes(bytes(range(1, 101)))
    train, val, info = load_splits([str(path)], val_fraction=0.1)
    assert train.tokens.tolist() == list(range(1, 91)) + [EOD]
    assert val.tokens.tolist() == list(range(91, 101)) + [EOD]
    assert "one file" in info["split"]


def test_resolve_dedupes_globs_and_skips_hidden(corpus: Path) -> None:
    (corpus / ".hidden").mkdir()
    (corpus / ".hidden" / "x.txt").write_text("secret")
    (corpus / ".dotfile").write_text("secret")
    files = sources.resolve_files([str(corpus), str(corpus / "sub0" / "*.txt"), str(corpus)])
    assert files == sorted(corpus.rglob("doc*.txt"))
    pattern = str(corpus / "**" / "doc0?.txt")
    assert sources.resolve_files([pattern]) == sorted(corpus.rglob("doc0?.txt"))


def test_large_files_in_directories_are_skipped_with_a_warning(
    corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    big = corpus / "big.txt"
    big.write_text("x" * 5000)
    monkeypatch.setattr(sources, "MAX_FILE_BYTES", 4000)
    with pytest.warns(UserWarning, match="big.txt"):
        files = sources.resolve_files([str(corpus)])
    assert big not in files and len(files) == 20
    assert sources.resolve_files([str(big)]) == [big]  # named directly: the user means it


def test_source_errors_are_helpful(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"'.*nope\.txt' does not exist"):
        load_splits([str(tmp_path / "nope.txt")])
    with pytest.raises(DataError, match=r"matched no files.*quote"):
        load_splits([str(tmp_path / "*.missing")])
    with pytest.raises(DataError, match="empty"):
        load_splits([])
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no usable files"):
        load_splits([str(tmp_path / "empty")])
    with pytest.raises(DataError, match="val_fraction"):
        load_splits(None, val_fraction=1.5)
    with pytest.raises(DataError, match="max_bytes"):
        sources.resolve_files(None, max_bytes=0)
    (tmp_path / "small.txt").write_text("more than ten bytes")
    with pytest.raises(DataError, match="max_bytes=10 is smaller than every data file; raise it"):
        load_splits([str(tmp_path / "small.txt")], max_bytes=10)


# --- batches -----------------------------------------------------------------------------------


def test_batches_are_a_pure_function_of_seed_and_step(stream: TokenStream) -> None:
    a, b = Batcher(stream, 16, 8, seed=1), Batcher(stream, 16, 8, seed=1)
    first = a.batch(3)
    assert first["inputs"].shape == first["targets"].shape == (8, 16)
    assert first["inputs"].dtype == first["targets"].dtype == np.int32
    for key in ("inputs", "targets"):
        assert np.array_equal(first[key], b.batch(3)[key])
    assert not np.array_equal(first["inputs"], a.batch(4)["inputs"])
    assert not np.array_equal(first["inputs"], Batcher(stream, 16, 8, seed=2).batch(3)["inputs"])


def test_batches_resume_without_state(stream: TokenStream) -> None:
    full_run = Batcher(stream, 16, 8, seed=7)
    history = [full_run.batch(s) for s in range(10)]
    resumed = Batcher(stream, 16, 8, seed=7)
    for step in range(5, 10):
        assert np.array_equal(resumed.batch(step)["inputs"], history[step]["inputs"])
        assert np.array_equal(resumed.batch(step)["targets"], history[step]["targets"])


def test_targets_are_inputs_shifted_by_one(stream: TokenStream) -> None:
    batcher = Batcher(stream, 16, 8, seed=0)
    batch = batcher.batch(0)
    assert np.array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    tokens = stream.tokens.astype(np.int32)
    for row, start in enumerate(batcher.offsets(0)):
        assert np.array_equal(batch["inputs"][row], tokens[start : start + 16])
        assert np.array_equal(batch["targets"][row], tokens[start + 1 : start + 17])


@pytest.mark.parametrize("num_shards", [2, 4])
def test_shards_concatenate_to_the_global_batch(stream: TokenStream, num_shards: int) -> None:
    batcher = Batcher(stream, 16, 8, seed=3)
    whole = batcher.batch(2)
    shards = [batcher.batch(2, shard=i, num_shards=num_shards) for i in range(num_shards)]
    for key in ("inputs", "targets"):
        assert all(s[key].shape == (8 // num_shards, 16) for s in shards)
        assert np.array_equal(np.concatenate([s[key] for s in shards]), whole[key])


def test_shard_builds_only_its_rows(stream: TokenStream, monkeypatch: pytest.MonkeyPatch) -> None:
    built = []
    original = stream.windows

    def spy(starts: np.ndarray, length: int) -> np.ndarray:
        built.append(len(starts))
        return original(starts, length)

    monkeypatch.setattr(stream, "windows", spy)
    Batcher(stream, 16, 8, seed=0).batch(0, shard=1, num_shards=4)
    assert built == [2]


def test_eval_batches_ignore_training_seed(stream: TokenStream) -> None:
    evals = Batcher(stream, 16, 4, seed=1).eval_batches(3)
    other = Batcher(stream, 16, 4, seed=99).eval_batches(3)
    assert len(evals) == 3 and all(b["inputs"].shape == (4, 16) for b in evals)
    for x, y in zip(evals, other, strict=True):
        assert np.array_equal(x["inputs"], y["inputs"])
    assert not np.array_equal(evals[0]["inputs"], evals[1]["inputs"])


def test_batch_errors_are_helpful(stream: TokenStream) -> None:
    with pytest.raises(DataError, match=r"not divisible by 3.*multiple of 3, e\.g\. 9"):
        Batcher(stream, 16, 8, seed=0).batch(0, shard=0, num_shards=3)
    with pytest.raises(DataError, match="shorter seq_len"):
        Batcher(stream, len(stream) - 1, 8, seed=0)
    with pytest.raises(DataError, match="seq_len must be >= 1"):
        Batcher(stream, 0, 8, seed=0)
    with pytest.raises(DataError, match="shard"):
        Batcher(stream, 16, 8, seed=0).batch(0, shard=4, num_shards=4)


@pytest.mark.parametrize("module", ["tokenizer", "sources", "stream", "corpus"])
def test_module_does_not_import_jax(module: str) -> None:
    # The CLI imports data before it has chosen the device count; importing jax would fix it early.
    tree = ast.parse(Path(importlib.import_module(f"meshlm.data.{module}").__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(name.split(".")[0] in ("jax", "haiku") for name in imported)
