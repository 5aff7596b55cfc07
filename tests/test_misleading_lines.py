"""Lines that misled (issue 66, item 5), each now saying what happened and the fix: an empty chat file
(not "see --overlong"), every conversation longer than a row (the --seq-len named), a prompt as long as
the context (never "use max_new_tokens <= 0", which is refused), a line that is not JSON among other bad
records (validation goes on: every bad record named, as docs/data.md promises). The stall watch's line:
tests/test_watchdog.py; an emptied manifest.ocdbt: tests/test_checkpoint.py. No devices: quick."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import run_cli

from meshlm.errors import DataError

GOOD = {"messages": [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}]}
BAD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": 5}]}


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    from test_chat_sft import EXAMPLES as CHAT
    from test_chat_sft import chat_tokenizer_dir

    return chat_tokenizer_dir(tmp_path_factory.mktemp("tok") / "t", (CHAT / "chatml.jinja").read_text())


def _chat(chatml, data, out, seq_len="64") -> int:
    argv = ("data", "prepare", "--chat", "--tokenizer", str(chatml), "--seq-len", seq_len)
    return run_cli(*argv, "--data", str(data), "--out", str(out))


def test_an_empty_chat_file_says_it_holds_no_conversation(tmp_path, chatml, capsys):
    data = tmp_path / "empty.jsonl"
    data.write_text("\n")
    assert _chat(chatml, data, tmp_path / "out") == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"meshlm: error: --data {data} holds no conversation (no record in it); pass files of "
        "conversations (`messages`, or `prompt` and `completion`)"
    )
    assert not (tmp_path / "out").exists()


def test_every_conversation_too_long_names_the_row_and_the_fix(tmp_path, chatml, capsys):
    data = tmp_path / "chat.jsonl"
    data.write_text((json.dumps(GOOD) + "\n") * 20)
    assert _chat(chatml, data, tmp_path / "out", seq_len="4") == 2
    err = capsys.readouterr().err.strip()
    assert "are longer than a row of 5 tokens and were dropped; pass a larger --seq-len, or --overlong" in err


def test_a_prompt_as_long_as_the_context_is_told_to_shorten_it():
    from meshlm.errors import GenerationError
    from meshlm.generate.inputs import check_budget

    with pytest.raises(GenerationError) as e:
        check_budget([np.ones(64, np.int32)], 1, 64)
    assert "fills the whole context of 64 tokens, leaving no room for a new token" in str(e.value)
    assert "<= 0" not in str(e.value)


@pytest.mark.parametrize("kind", ["chat", "pairs"])
def test_a_line_that_is_not_json_does_not_stop_validation(tmp_path, kind):
    """Records before and after a malformed line are all checked and named in the one error."""
    from meshlm.data.chat_store import read_conversations
    from meshlm.data.pairs import read_pairs

    pair = {"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 5"}
    good, bad = (GOOD, BAD) if kind == "chat" else (pair, {**pair, "chosen": 4})
    data = tmp_path / "d.jsonl"
    lines = [good, bad, good, '{"messages": [', good, bad, good]
    data.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    with pytest.raises(DataError) as e:
        read_conversations([data], "assistant") if kind == "chat" else read_pairs([data])
    message = str(e.value)
    assert message.startswith(f"{data}:2: ")
    assert "(3 of 7 " in message and f"the others: {data}:4, {data}:6)" in message, message
