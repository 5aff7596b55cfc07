"""Chat and pair records checked before any work (issue 59, item 4): every bad record named by FILE:LINE
with what was found, all of them in one error, nothing written; flags of another kind of data refused;
DPO given another kind of data told what it needs and how to make it; pairs whose chosen equals their
rejected counted in one warning. Pure Python (no devices): quick."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers import run_cli

from meshlm.data.chat import conversation, conversation_problem
from meshlm.data.pairs import read_pairs
from meshlm.errors import DataError

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
GOOD = {"messages": [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}]}


def jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def with_content(content, role="assistant"):
    return {"messages": [{"role": "user", "content": "hi"}, {"role": role, "content": content}]}


@pytest.mark.parametrize(
    "row, found",
    [
        (with_content(5), r"message 1 \(assistant\): content is a number \(5\)"),
        (with_content(None), r"message 1 \(assistant\): content is null"),
        (with_content([1, 2]), r"content part 0 is a number \(1\)"),
        (
            with_content([{"type": "image_url", "image_url": {}}]),
            r"content part 0 is of type 'image_url' \(only text",
        ),
        (with_content({"text": "4"}), r"content is an object \(fields: text\)"),
        (with_content("4", role=None), r"message 1's role is null"),
        (with_content("4", role=["assistant"]), r"message 1's role is a list of 1"),
        ({"messages": "hello"}, r"its `messages` is a string \('hello'\)"),
        ({"messages": [{"role": "user"}]}, r"message 0 has no `content` \(its fields: role\)"),
        ({"prompt": "hi", "completion": 4}, r"its `completion` is a number \(4\)"),
        ({"text": "plain"}, r"is not a conversation \(its fields: text\)"),
        (["user", "hi"], r"is a list of 2, not an object"),
    ],
)
def test_a_bad_message_is_named_with_what_was_found(row, found):
    with pytest.raises(DataError, match=r"^chat.jsonl:7: (message 1 \(assistant\): )?" + found):
        conversation(row, "chat.jsonl:7")


def test_text_content_parts_are_joined_and_a_conversation_needs_an_assistant_turn():
    parts = [{"type": "text", "text": "four"}, {"type": "text", "text": "(4)"}]
    messages = conversation(with_content(parts), "row")
    assert messages[1] == {"role": "assistant", "content": "four\n(4)"}
    assert conversation(GOOD, "row") == GOOD["messages"]
    user_only = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}
    _, problem = conversation_problem(user_only, "assistant")
    assert "no assistant turn" in problem and "(its roles: system, user)" in problem
    assert conversation_problem(user_only, "all")[1] is None  # --train-on all trains on it


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    from test_chat_sft import EXAMPLES as CHAT
    from test_chat_sft import chat_tokenizer_dir

    return chat_tokenizer_dir(tmp_path_factory.mktemp("tok") / "t", (CHAT / "chatml.jinja").read_text())


def test_chat_prepare_names_every_bad_record_and_writes_nothing(tmp_path, chatml, capsys):
    from meshlm.data.chat_store import load_template, prepare_chat

    rows = [GOOD] * 4 + [with_content(5)] + [GOOD] * 3 + [with_content([{"type": "image"}])] + [GOOD]
    data = jsonl(tmp_path / "chat.jsonl", rows)
    out = tmp_path / "store"
    with pytest.raises(DataError) as e:
        prepare_chat([data], load_template(chatml), out, seq_len=64)
    assert str(e.value).startswith(f"{data}:5: message 1 (assistant): content is a number (5)")
    assert f"2 of 10 conversations are bad; the others: {data}:9)" in str(e.value)
    assert not out.exists()  # nothing tokenized into it, nothing written
    args = ("data", "prepare", "--chat", "--tokenizer", str(chatml), "--seq-len", "64")
    assert run_cli(*args, "--data", str(data), "--out", str(out)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"meshlm: error: {data}:5: ") and not out.exists()


def test_a_template_refusal_names_the_record(tmp_path, chatml):
    """A template's own raise_exception (roles out of order) and a failure in its expressions: the
    record's FILE:LINE and the template's words, never a Jinja traceback."""
    from meshlm.data.chat import ChatTemplate
    from meshlm.data.chat_store import prepare_chat
    from meshlm.data.tokenizer_files import load_tokenizer

    strict = (
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tok = load_tokenizer(chatml / "tokenizer.json")
    twice = {"messages": [GOOD["messages"][0], *GOOD["messages"]]}
    data = jsonl(tmp_path / "c.jsonl", [GOOD, GOOD, twice, GOOD])
    with pytest.raises(DataError, match=re.escape(f"{data}:3: the chat template refused the conversation: ")):
        prepare_chat([data], ChatTemplate(strict, tok), tmp_path / "s", seq_len=64)
    broken = "{% for m in messages %}{{ m['content'] + 1 }}{% endfor %}"
    with pytest.raises(
        DataError, match=re.escape(f"{data}:1: the chat template failed on the conversation (")
    ):
        prepare_chat([data], ChatTemplate(broken, tok), tmp_path / "s", seq_len=64, train_on="all")
    assert not (tmp_path / "s").exists()


def test_bad_pairs_are_named_and_equal_pairs_counted(tmp_path):
    pair = {"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 5"}
    same = {"prompt": "1 + 1 =", "chosen": " 2", "rejected": " 2"}
    bad = jsonl(tmp_path / "bad.jsonl", [pair, {**pair, "chosen": 4}, pair, {"prompt": "x", "chosen": None}])
    with pytest.raises(DataError) as e:
        read_pairs([bad])
    assert str(e.value).startswith(f"{bad}:2: not a preference pair: `chosen` is a number (4)")
    assert f"(2 of 4 records are bad; the others: {bad}:4)" in str(e.value)
    with pytest.raises(DataError, match=r":4: not a preference pair: `chosen` is null, no `rejected`"):
        read_pairs([jsonl(tmp_path / "b2.jsonl", [pair, pair, pair, {"prompt": "x", "chosen": None}])])
    good = jsonl(tmp_path / "same.jsonl", [pair, same, pair, same])
    with pytest.warns(
        UserWarning, match=rf"^2 of 4 preference pairs have `chosen` equal to `rejected` \({good}:2, "
    ):
        assert len(read_pairs([good])) == 4


def test_dpo_given_another_kind_of_data_names_what_it_needs_and_how_to_make_it(tmp_path):
    make = "meshlm data prepare --pairs --tokenizer DIR --data pairs.jsonl --seq-len N --out STORE"
    chat = EXAMPLES / "chat" / "conversations.jsonl"
    with pytest.raises(DataError, match=rf"holds no preference pair \(at {chat}:1: not a preference pair "):
        read_pairs([chat])
    with pytest.raises(DataError, match=re.escape(make)):
        read_pairs([chat])
    text = jsonl(tmp_path / "text.jsonl", [{"text": "hello"}, {"text": "world"}])
    with pytest.raises(DataError, match=r"no `prompt`, no `chosen`, no `rejected` \(its fields: text\)"):
        read_pairs([text])
    store, rows = tmp_path / "store", [{"text": f"document {i}"} for i in range(40)]
    assert (
        run_cli(
            "data",
            "prepare",
            "--data",
            str(jsonl(tmp_path / "t.jsonl", rows)),
            "--val-fraction",
            "0.5",
            "--out",
            str(store),
        )
        == 0
    )
    with pytest.raises(DataError, match=rf"{store} is a token store .*; .*{re.escape(make)}"):
        read_pairs([store])
    with pytest.raises(DataError, match=r"--objective dpo reads .jsonl"):
        read_pairs([jsonl(tmp_path / "notes.txt", ["plain text"])])


@pytest.mark.parametrize(
    "flags, error",
    [
        (["--chat", "--pairs"], "--chat and --pairs are two kinds of data"),
        (["--pairs", "--train-on", "all"], "--train-on applies to --chat data, not to --pairs data; drop it"),
        (
            ["--pairs", "--val-fraction", "0.2"],
            r"--val-fraction applies to a text corpus \(no --chat, no --pairs\) and --chat data, "
            "not to --pairs",
        ),
        (["--chat", "--text-field", "body"], "--text-field applies to a text corpus .*, not to --chat data"),
        (["--chat", "--workers", "2"], "--workers applies to a text corpus"),
        (["--seq-len", "64"], r"--seq-len applies to --chat data and --pairs data, not to a text corpus"),
        (["--overlong", "truncate"], "--overlong applies to --chat data, not to a text corpus"),
    ],
)
def test_flags_of_another_kind_of_data_are_refused(tmp_path, capsys, flags, error):
    out = tmp_path / "out"
    assert (
        run_cli("data", "prepare", "--data", str(EXAMPLES / "dpo" / "pairs.jsonl"), *flags, "--out", str(out))
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(error, err[0]), err
    assert not out.exists()


def test_a_pair_store_given_where_text_or_conversations_go_is_named(tmp_path):
    from meshlm.data.store import open_store

    store = tmp_path / "pairs"
    pairs = str(EXAMPLES / "dpo" / "pairs.jsonl")
    assert run_cli("data", "prepare", "--pairs", "--data", pairs, "--seq-len", "48", "--out", str(store)) == 0
    pair_store = r"is a pair store \(`meshlm data prepare --pairs`\).*--objective dpo"
    with pytest.raises(DataError, match=pair_store):
        open_store(store)
