"""Damaged inputs are one line naming the file (and the record) before any work, never a traceback
(issue 66, item 2): a JSON line nested past the recursion limit, a corrupt or truncated Parquet file,
an Arrow IPC file (read as Arrow, not Parquet), a truncated or non-gzip .jsonl.gz, a DPO data directory
whose index.json is garbage or a list, a --seq-len no model has, a tokenizer_config.json that is not
JSON, a list or not UTF-8 (``data prepare`` and ``convert --from-hf``, which refuses it and a broken
generation_config.json instead of copying them). In-process CLI calls without devices: quick."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest
from helpers import run_cli

GOOD = {"messages": [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}]}
PAIR = {"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 5"}
NESTED = "[" * 100_000 + "]" * 100_000  # json.loads: RecursionError, not ValueError


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    from test_chat_sft import EXAMPLES as CHAT
    from test_chat_sft import chat_tokenizer_dir

    return chat_tokenizer_dir(tmp_path_factory.mktemp("tok") / "t", (CHAT / "chatml.jinja").read_text())


def one_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("meshlm: error: "), err
    return lines[0]


def prepare(kind: str, tokenizer, data, out: Path, *extra: str) -> int:
    return run_cli(
        "data", "prepare", f"--{kind}", "--tokenizer", str(tokenizer), "--data", str(data),
        "--seq-len", "64", "--out", str(out), *extra,
    )  # fmt: skip


def arrow_file(path: Path, rows: list[dict], stream: bool = False) -> Path:
    import pyarrow as pa

    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(path), "wb") as f:
        writer = (pa.ipc.new_stream if stream else pa.ipc.new_file)(f, table.schema)
        writer.write_table(table)
        writer.close()
    return path


def damaged(tmp_path: Path, case: str, row: dict) -> tuple[Path, str]:
    """(a damaged record file, the words its error must hold)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    lines = (json.dumps(row) + "\n") * 50
    if case == "nested":
        path = tmp_path / "d.jsonl"
        path.write_text(lines + NESTED + "\n")
        return path, f"{path}:51: not JSON that can be read (nested deeper than Python's recursion limit)"
    if case in ("truncated-gz", "not-gz"):
        path = tmp_path / "d.jsonl.gz"
        packed = gzip.compress(lines.encode())
        path.write_bytes(packed[: len(packed) // 2] if case == "truncated-gz" else lines.encode())
        why = "Compressed file ended" if case == "truncated-gz" else "Not a gzipped file"
        return path, f"cannot read data file {path} ({why}"
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([row] * 50), path)
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 2] if case == "truncated-parquet" else b"PAR1" + b"\x07" * 900)
    return path, f"cannot read data file {path} ("


@pytest.mark.parametrize("kind", ["chat", "pairs"])
@pytest.mark.parametrize("case", ["nested", "truncated-gz", "not-gz", "truncated-parquet", "corrupt-parquet"])
def test_a_damaged_record_file_is_one_line_naming_it(tmp_path, chatml, capsys, kind, case):
    path, words = damaged(tmp_path, case, GOOD if kind == "chat" else PAIR)
    out = tmp_path / "out"
    assert prepare(kind, chatml, path, out) == 2
    assert words in one_error(capsys)
    assert not out.exists()


def test_a_nested_line_in_a_text_corpus_is_one_line(tmp_path, capsys):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": "hello"}) + "\n" + NESTED + "\n")
    assert run_cli("data", "prepare", "--data", str(path), "--out", str(tmp_path / "out")) == 2
    assert f"data file {path} line 2 is not JSON that can be read (nested deeper" in one_error(capsys)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("kind", ["chat", "pairs"])
def test_an_arrow_file_is_read_as_arrow(tmp_path, chatml, capsys, kind, stream):
    """docs/data.md lists .arrow (the IPC file and stream formats, as save_to_disk writes them)."""
    rows = [GOOD if kind == "chat" else {**PAIR, "prompt": f"{i} + 2 ="} for i in range(40)]
    path = arrow_file(tmp_path / "d.arrow", rows, stream)
    out = tmp_path / "out"
    assert prepare(kind, chatml, path, out) == 0, capsys.readouterr().err
    index = json.loads((out / "index.json").read_text())
    if kind == "chat":
        assert sum(index["splits"][s]["conversations"] for s in ("train", "val")) == 40
    else:
        assert sum(index["splits"][s]["pairs"] for s in ("train", "val")) == 40


@pytest.mark.parametrize("index", ["garbage {", "[1, 2]"])
def test_a_dpo_directory_with_a_damaged_index_is_one_line(tmp_path, chatml, capsys, index):
    from meshlm.data.pair_store import is_pair_store
    from meshlm.errors import DataError

    store = tmp_path / "pairs"
    store.mkdir()
    (store / "index.json").write_text(index)
    assert prepare("pairs", chatml, store, tmp_path / "out") == 2
    line = one_error(capsys)
    assert f"{store / 'index.json'} " in line and "re-create it with `meshlm data prepare`" in line
    with pytest.raises(DataError, match="index.json (is not readable JSON|holds list JSON)"):
        is_pair_store(store)  # what `train --objective dpo --data DIR` asks first


def test_a_pair_store_index_missing_fields_is_one_line(tmp_path, chatml):
    from meshlm.data.pair_store import load_pair_store
    from meshlm.data.tokenizer_files import load_tokenizer
    from meshlm.errors import DataError

    store = tmp_path / "pairs"
    store.mkdir()
    (store / "index.json").write_text(json.dumps({"format": "meshlm-pair-store-1"}))
    tok = load_tokenizer(chatml / "tokenizer.json")
    with pytest.raises(DataError, match=r"its index.json lacks or mangles a field \(KeyError"):
        load_pair_store(store, tok, 64)


@pytest.mark.parametrize("kind", ["chat", "pairs"])
def test_a_seq_len_no_model_has_is_refused_while_parsing(tmp_path, chatml, capsys, kind):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(GOOD if kind == "chat" else PAIR) + "\n")
    argv = ("data", "prepare", f"--{kind}", "--tokenizer", str(chatml), "--data", str(data))
    with pytest.raises(SystemExit) as exc:
        run_cli(*argv, "--seq-len", "1000000000000", "--out", str(tmp_path / "o"))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "argument --seq-len: must be an integer in [1, 16,777,216]" in err and "\n" not in err
    from meshlm.data.pair_store import prepare_pairs
    from meshlm.errors import DataError

    with pytest.raises(DataError, match=r"--seq-len must be an integer in \[1, 16,777,216\]"):
        prepare_pairs([data], None, tmp_path / "o", 2**40)  # library callers too, before any read


CONFIGS = {
    "not-json": (b"{not json", "is not valid JSON ("),
    "a-list": (b"[1, 2]", "holds a JSON list, not an object"),
    "not-utf8": ('{"eos_token": "caf\xe9"}'.encode("latin-1"), "cannot be read ('utf-8' codec"),
}


@pytest.mark.parametrize("case", list(CONFIGS))
@pytest.mark.parametrize("kind", ["chat", "pairs", "text"])
def test_a_damaged_tokenizer_config_is_one_line_naming_it(tmp_path, chatml, capsys, case, kind):
    tok = shutil.copytree(chatml, tmp_path / "tok")
    (tok / "tokenizer_config.json").write_bytes(CONFIGS[case][0])
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(GOOD if kind != "pairs" else PAIR) + "\n")
    out = tmp_path / "out"
    if kind == "text":
        code = run_cli("data", "prepare", "--tokenizer", str(tok), "--data", str(data), "--out", str(out))
    else:
        code = prepare(kind, tok, data, out)
    assert code == 2
    assert f"{tok / 'tokenizer_config.json'} {CONFIGS[case][1]}" in one_error(capsys)
    assert not out.exists()


@pytest.mark.parametrize("case", [*CONFIGS, "generation-config"])
def test_convert_refuses_a_companion_it_cannot_read(tmp_path, chatml, capsys, case):
    """Refused before any weight is read or anything written: no half-copied model directory."""
    model = shutil.copytree(chatml, tmp_path / "hf")
    name = "generation_config.json" if case == "generation-config" else "tokenizer_config.json"
    (model / name).write_bytes(b"{broken" if case == "generation-config" else CONFIGS[case][0])
    out = tmp_path / "ck"
    assert run_cli("convert", "--from-hf", str(model), "--out", str(out), "--mesh", "1x1") == 2
    words = "is not valid JSON (" if case == "generation-config" else CONFIGS[case][1]
    assert f"{model / name} {words}" in one_error(capsys)
    assert not out.exists()
