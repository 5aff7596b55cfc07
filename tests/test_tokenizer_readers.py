"""One check, every reader (issue 66, item 3): a checkpoint's tokenizer.json and its companions (the chat
template above all) are read only against the SHA-256 its meta records, by `data prepare --tokenizer
CHECKPOINT` (text, --chat, --pairs) as by train, generate, eval and convert; an edited template is one
line naming the file, and the intact one is the template every reader uses."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest
from helpers import run_cli

EXAMPLES_CHAT = "chatml.jinja"
GOOD = {"messages": [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}]}
PAIR = {"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 5"}
EDITED = "was modified or damaged after the checkpoint was saved (its SHA-256 differs"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A converted tiny Qwen3 checkpoint whose tokenizer carries a ChatML template (chat_template.jinja)."""
    from test_chat_sft import EXAMPLES, chat_tokenizer_dir

    from meshlm.io import hf_weights
    from meshlm.model.config import get_config
    from meshlm.model.params import flat_params
    from meshlm.train.step import init_model

    tmp = tmp_path_factory.mktemp("ck")
    hf = chat_tokenizer_dir(tmp / "hf", (EXAMPLES / EXAMPLES_CHAT).read_text())
    cfg = get_config("tiny-qwen3").replace(vocab_size=320)
    params, _ = init_model(cfg, jax.make_mesh((1, 1), ("dp", "mp"), devices=jax.devices()[:1]), seed=0)
    hf_weights.save_hf(cfg, {k: np.asarray(v) for k, v in flat_params(params).items()}, hf)
    assert run_cli("convert", "--from-hf", str(hf), "--out", str(tmp / "ck"), "--mesh", "1x1") == 0
    assert (tmp / "ck" / "chat_template.jinja").is_file()
    (tmp / "chat.jsonl").write_text((json.dumps(GOOD) + "\n") * 30)
    (tmp / "pairs.jsonl").write_text((json.dumps(PAIR) + "\n") * 30)
    (tmp / "text.txt").write_text("hello world\n" * 50)
    return tmp


def _prepare(kind: str, tokenizer, data, out) -> list[str]:
    extra = () if kind == "text" else (f"--{kind}", "--seq-len", "64")
    return ["data", "prepare", *extra, "--tokenizer", str(tokenizer), "--data", str(data), "--out", str(out)]


DATA = {"chat": "chat.jsonl", "pairs": "pairs.jsonl", "text": "text.txt"}


@pytest.mark.parametrize("kind", list(DATA))
def test_data_prepare_reads_a_checkpoints_tokenizer_checked(checkpoint, tmp_path, capsys, kind):
    edited = shutil.copytree(checkpoint / "ck", tmp_path / "edited")
    with open(edited / "chat_template.jinja", "a") as f:
        f.write("{{ 'a line the checkpoint never had' }}")
    out = tmp_path / "out"
    for spec in (edited, edited / "tokenizer.json"):  # the run directory, or the file it carries
        assert run_cli(*_prepare(kind, spec, checkpoint / DATA[kind], out)) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{edited / 'chat_template.jinja'} {EDITED}" in err[0], err
        assert not out.exists()
    assert run_cli(*_prepare(kind, checkpoint / "ck", checkpoint / DATA[kind], out)) == 0  # intact: taken


def test_the_template_every_reader_uses_is_the_checkpoints(checkpoint):
    """data prepare's template (read from the checkpoint) is the one generate and DPO read."""
    from meshlm.data.chat_store import load_template
    from meshlm.data.pairs import renderer_for
    from meshlm.train.tokenizers import checkpoint_tokenizer, tokenizer_at

    tok = tokenizer_at(checkpoint / "ck")
    assert tok.files == checkpoint_tokenizer(checkpoint / "ck").files
    assert load_template(tok).text == (checkpoint / "ck" / "chat_template.jinja").read_text()
    assert renderer_for(tok).template is not None
