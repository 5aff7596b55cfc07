"""Tokenizers: the byte tokenizer and a trained byte-level BPE behind one interface; token streams
through either; loading errors."""

from __future__ import annotations

import json
from functools import partial

import numpy as np
import pytest
from helpers import tiny_lm_config
from hypothesis import given, settings
from hypothesis import strategies as st

from meshlm.data.bpe import train_bpe
from meshlm.data.corpus import load_splits
from meshlm.data.hf_tokenizer import EOD_TOKEN, HFTokenizer
from meshlm.data.stream import Batcher, TokenStream
from meshlm.data.tokenizer import ByteTokenizer, token_dtype
from meshlm.data.tokenizer_files import load_tokenizer
from meshlm.errors import DataError

TEXT = "def add(a, b):\n    return a + b\n\nclass Thing:\n    pass\n# héllo wörld, ünïcode: 日本語 🎉\n" * 20


@pytest.fixture(scope="module")
def bpe() -> HFTokenizer:
    return train_bpe([TEXT, "import os\nimport sys\n" * 10], 320)


@pytest.fixture(scope="module")
def bpe_file(bpe, tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_text(bpe.to_json())
    return path


def test_bpe_has_all_bytes_and_eod(bpe):
    assert bpe.vocab_size == 320 and bpe.eod_id == 0
    assert bpe.tok.id_to_token(0) == EOD_TOKEN
    assert bpe.dtype == np.uint16 and ByteTokenizer().dtype == np.uint8 and token_dtype(70000) == np.uint32
    # Merges make text shorter than its bytes; token_bytes adds back up to the bytes exactly.
    ids = bpe.encode(TEXT)
    assert len(ids) < len(TEXT.encode()) // 2
    assert int(bpe.token_bytes[ids].sum()) == len(TEXT.encode())
    assert bpe.token_bytes[bpe.eod_id] == 1


# Text, not the EOD token's own spelling: that is the document boundary (one byte by design, above),
# which hypothesis once drew as the whole text (session 19: 1 byte counted against its 13)
@settings(max_examples=150, deadline=None)
@given(st.text().filter(lambda t: EOD_TOKEN not in t))
def test_bpe_round_trips_any_text(bpe, text):
    ids = bpe.encode(text)
    assert bpe.decode(ids) == text
    assert int(bpe.token_bytes[ids].sum()) == len(text.encode("utf-8"))


def test_load_tokenizer_specs(bpe, bpe_file):
    assert isinstance(load_tokenizer("bytes"), ByteTokenizer) and isinstance(
        load_tokenizer(None), ByteTokenizer
    )
    loaded = load_tokenizer(bpe_file)
    assert loaded.fingerprint == bpe.fingerprint and loaded.vocab_size == bpe.vocab_size
    assert load_tokenizer(bpe_file.parent).fingerprint == bpe.fingerprint  # a directory holding one
    assert bpe.fingerprint != ByteTokenizer().fingerprint


def test_unloadable_tokenizers_are_one_line_errors(tmp_path, bpe):
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"model": {"type": "nonsense"}}')
    with pytest.raises(DataError, match="does not load as a Hugging Face tokenizer.json") as e:
        load_tokenizer(bad)
    assert "\n" not in str(e.value)
    with pytest.raises(DataError, match="no such file"):
        load_tokenizer(tmp_path / "missing.json")
    no_eod = json.loads(bpe.to_json())
    no_eod["added_tokens"] = []
    bad.write_text(json.dumps(no_eod))
    with pytest.raises(DataError, match="no end-of-document special token"):
        load_tokenizer(bad)


def test_streams_through_a_tokenizer(bpe, tmp_path):
    files = []
    for i in range(6):
        files.append(tmp_path / f"f{i}.py")
        files[-1].write_text(TEXT[: 200 + 50 * i])
    stream = TokenStream.from_files(files, bpe)
    assert stream.tokens.dtype == np.uint16 and stream.num_docs == 6
    assert stream.text_bytes == sum(len(f.read_bytes()) + 1 for f in files)
    docs = bpe.decode(stream.tokens).split(EOD_TOKEN)
    assert docs[:-1] == [f.read_text() for f in files] and docs[-1] == ""
    batch = Batcher(stream, 16, 4, seed=1).batch(3)
    assert batch["inputs"].dtype == np.int32 and batch["inputs"].max() < bpe.vocab_size
    train, val, info = load_splits([str(tmp_path)], val_fraction=0.3, tokenizer=bpe)
    assert info["train_tokens"] == len(train) and info["train_bytes"] == train.text_bytes > len(train)
    # The byte path is unchanged: same stream as before, bytes == tokens.
    b_train, _, b_info = load_splits([str(tmp_path)], val_fraction=0.3)
    assert b_train.tokens.dtype == np.uint8 and b_info["train_bytes"] == len(b_train)
    assert len(b_train) == train.text_bytes


# --- training runs and checkpoints with a tokenizer -------------------------------------------


_tcfg = partial(tiny_lm_config, steps=2, batch_size=4, seq_len=16, save_every=2, sample_tokens=8)


# slow: a whole training run (its cost); the run's tokenizer record: tests/test_convert_carry.py, and a
# BPE run: the documented `meshlm train --tokenizer bpe-2048` (tests/test_docs_commands.py), both quick
@pytest.mark.slow
def test_training_run_carries_its_bpe_tokenizer(tmp_path):
    from helpers import read_metrics, write_corpus

    from meshlm.errors import CheckpointError, ConfigError
    from meshlm.io.checkpoint import Checkpointer
    from meshlm.io.model_io import read_config, save_model
    from meshlm.model.config import get_config
    from meshlm.parallel.mesh import make_mesh
    from meshlm.train.loop import train
    from meshlm.train.step import init_model
    from meshlm.train.tokenizers import checkpoint_tokenizer, tokenizer_meta

    (tmp_path / "c").mkdir()
    corpus, out = write_corpus(tmp_path / "c"), tmp_path / "run"
    summary = train(_tcfg(corpus, out, tokenizer="bpe-300"), make_mesh(1, 2))
    tok = load_tokenizer(out / "tokenizer.json")
    assert 257 < tok.vocab_size <= 300 and summary["sample"].startswith("def ")
    cfg, meta = read_config(out)
    assert cfg.vocab_size == tok.vocab_size  # from scratch, the tokenizer sets the vocabulary
    assert meta["tokenizer"]["kind"] == "hf" and meta["tokenizer"]["fingerprint"] == tok.fingerprint
    assert checkpoint_tokenizer(out).fingerprint == tok.fingerprint
    # val_bpb is per byte of text: below the loss in bits per token, since a token is several bytes
    last = [r for r in read_metrics(out) if "val_bpb" in r][-1]
    assert last["val_bpb"] < last["val_loss"] / np.log(2) / 2
    # Resuming (bpe-N again, or no --tokenizer) keeps it; another tokenizer is refused.
    assert train(_tcfg(corpus, out, steps=3, tokenizer="bpe-300"), make_mesh(1, 2))["step"] == 3
    with pytest.raises(ConfigError, match="differs from the tokenizer --out .* already has"):
        train(_tcfg(corpus, out, steps=4, tokenizer="bytes"), make_mesh(1, 2))
    with pytest.raises(ConfigError, match="differs from the tokenizer --checkpoint"):
        train(_tcfg(corpus, tmp_path / "ft", checkpoint=str(out), tokenizer="bytes"), make_mesh(1, 2))
    # A checkpoint whose model has fewer ids than its tokenizer, and a tampered tokenizer.json.
    small = get_config("tiny-lm")  # vocab 256
    meta = {"tokenizer": tokenizer_meta(tmp_path / "small", tok)}
    save_model(tmp_path / "small", small, init_model(small, make_mesh(1, 1), 0)[0], meta=meta)
    with pytest.raises(CheckpointError, match="vocab_size=256, smaller than its tokenizer's"):
        checkpoint_tokenizer(tmp_path / "small")
    (out / "tokenizer.json").write_text(tok.to_json().replace("return", "retvrn"))
    with pytest.raises(CheckpointError, match="modified or damaged after the checkpoint was saved"):
        checkpoint_tokenizer(out)
    with Checkpointer(out) as ckpt:
        assert ckpt.latest_step() == 3


@settings(max_examples=60, deadline=None)
@given(st.text(min_size=1))
def test_stream_never_splits_a_character_or_a_merge(bpe, text):
    from meshlm.generate.streaming import DiffStream

    ids = bpe.encode(text + " 日本語🎉")  # byte-level BPE: CJK and emoji span several byte tokens
    stream = DiffStream(bpe)
    pieces = [stream.feed(int(t)) for t in ids] + [stream.flush()]
    assert "".join(pieces) == text + " 日本語🎉"
    assert all("\ufffd" not in p for p in pieces) or "\ufffd" in text


def test_tokenizer_train_cli(tmp_path, capsys):
    from helpers import run_cli

    (tmp_path / "a.txt").write_text(TEXT)
    out = tmp_path / "tok.json"
    argv = ["tokenizer", "train", "--data", str(tmp_path / "a.txt"), "--out", str(out), "--json"]
    assert run_cli(*argv, "--vocab-size", "300") == 0
    summary = json.loads(capsys.readouterr().out)
    tok = load_tokenizer(out)
    assert summary["vocab_size"] == tok.vocab_size == 300 and summary["fingerprint"] == tok.fingerprint
    assert summary["bytes_per_token"] > 2
    assert run_cli(*argv, "--vocab-size", "300") == 2  # never overwrites
    assert "exists; choose a new path" in capsys.readouterr().err
    assert run_cli(*argv[:-3], "--out", str(tmp_path / "x.json"), "--vocab-size", "100") == 2
    assert "--vocab-size 100 is out of range" in capsys.readouterr().err
