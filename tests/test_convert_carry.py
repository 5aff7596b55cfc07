"""Every conversion carries the tokenizer and the files it comes with (tokenizer_config.json with its chat
template and special tokens, chat_template.jinja, special_tokens_map.json, generation_config.json):
``--from-hf`` into the checkpoint, a training run's directory, ``--to-hf``, ``--to-peft``,
``--from-peft`` and ``--merge``, byte for byte, each checked against its SHA-256 when read back; a LoRA
checkpoint exports merged. Without transformers: the model directory is meshlm's own export. The same
round trips against transformers and peft (logits, ``apply_chat_template``): tests/test_lora_peft.py."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import run_cli, save_lora_run

from meshlm.data.bpe import train_bpe
from meshlm.data.tokenizer_files import COMPANIONS
from meshlm.io import hf_weights
from meshlm.io.model_io import load_model
from meshlm.model.config import get_config
from meshlm.model.params import flat_params
from meshlm.train.step import init_model

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "chat"
ONE = ("--mesh", "1x1")
TEMPLATE = (EXAMPLES / "chatml.jinja").read_text()
FILES = {  # the tokenizer's companions as a transformers directory holds them (the template in the config)
    "tokenizer_config.json": json.dumps(
        {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "chat_template": TEMPLATE}, indent=1
    ),
    "special_tokens_map.json": json.dumps({"eos_token": "<|endoftext|>"}),
    "generation_config.json": json.dumps({"eos_token_id": [0, 5], "do_sample": False}),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(a transformers directory of a tiny random Qwen3 with a BPE tokenizer and its companions, the
    checkpoint ``convert --from-hf`` made of it)."""
    tmp = tmp_path_factory.mktemp("carry")
    cfg = get_config("tiny-qwen3").replace(vocab_size=320)
    mesh = jax.make_mesh((1, 1), ("dp", "mp"), devices=jax.devices()[:1])
    params, _ = init_model(cfg, mesh, seed=3)
    hf_weights.save_hf(cfg, {k: np.asarray(v) for k, v in flat_params(params).items()}, tmp / "hf")
    (tmp / "hf" / "tokenizer.json").write_text(
        train_bpe([(EXAMPLES / "conversations.jsonl").read_text()], 300).to_json()
    )
    for name, text in FILES.items():
        (tmp / "hf" / name).write_text(text)
    assert run_cli("convert", "--from-hf", str(tmp / "hf"), "--out", str(tmp / "ck"), *ONE) == 0
    return tmp


def _carried(directory: Path, want: Path) -> None:
    """``directory`` holds ``want``'s tokenizer.json and every companion, byte for byte."""
    names = [n for n in ("tokenizer.json", *COMPANIONS) if (want / n).is_file()]
    assert len(names) == 4
    for name in names:
        assert (directory / name).read_bytes() == (want / name).read_bytes(), (directory, name)


def test_from_hf_to_hf_carry_the_files_and_a_changed_one_is_found(model, capsys):
    tmp = model
    _carried(tmp / "ck", tmp / "hf")
    capsys.readouterr()
    assert run_cli("convert", "--to-hf", str(tmp / "ck"), "--out", str(tmp / "back"), *ONE) == 0
    assert "tokenizer_config.json (with its chat template)" in capsys.readouterr().out
    _carried(tmp / "back", tmp / "hf")
    # the documented `data prepare --chat --tokenizer CONVERTED`: the template is the checkpoint's
    prepare = ["data", "prepare", "--chat", "--tokenizer", str(tmp / "ck"), "--data"]
    assert (
        run_cli(*prepare, str(EXAMPLES / "conversations.jsonl"), "--seq-len", "256", "--out", str(tmp / "d"))
        == 0
    )
    bad = tmp / "bad"
    bad.mkdir()
    for p in (tmp / "ck").iterdir():
        (bad / p.name).symlink_to(p)
    (bad / "special_tokens_map.json").unlink()
    (bad / "special_tokens_map.json").write_text("{}")
    capsys.readouterr()
    assert run_cli("convert", "--to-hf", str(bad), "--out", str(tmp / "x"), *ONE) == 2
    err = capsys.readouterr().err
    assert "special_tokens_map.json was modified or damaged" in err and err.count("\n") == 1


def test_a_training_run_keeps_them(model):
    """What train does with --checkpoint's tokenizer (``run_tokenizer``, then ``tokenizer_meta`` into
    the run directory): every file kept, and a resumed run reads them back from its own directory."""
    from meshlm.data.tokenizer_files import stop_ids
    from meshlm.train.config import TrainConfig
    from meshlm.train.tokenizers import checkpoint_tokenizer, run_tokenizer, tokenizer_meta

    tmp = model
    cfg = get_config("tiny-qwen3").replace(vocab_size=320)
    tok, _ = run_tokenizer(TrainConfig(checkpoint=str(tmp / "ck"), out=str(tmp / "run")), cfg)
    entry = tokenizer_meta(tmp / "run", tok)
    assert sorted(entry["files"]) == sorted(FILES)
    _carried(tmp / "run", tmp / "hf")
    assert checkpoint_tokenizer(tmp / "ck").files == FILES
    # a trained run's meta names no EOS ids: generate and --to-hf stop at its generation_config's
    assert stop_ids({}, tok) == [0, 5]


def test_lora_conversions_carry_them_and_to_hf_exports_merged(model, capsys):
    """A LoRA checkpoint without a tokenizer of its own (the base's is taken): --merge, --to-peft,
    --from-peft carry the files; --to-hf writes the merged weights, those --merge writes."""
    from meshlm.data.pairs import renderer_for
    from meshlm.train.tokenizers import checkpoint_tokenizer

    tmp = model
    mesh = jax.make_mesh((1, 1), ("dp", "mp"), devices=jax.devices()[:1])
    base_cfg, base, _ = load_model(tmp / "ck", mesh)
    cfg = base_cfg.replace(lora_rank=2, lora_alpha=4.0, lora_targets="q,v")
    save_lora_run(cfg, base, tmp / "lora", tmp / "ck")
    for argv in (
        ("--merge", str(tmp / "lora"), "--out", str(tmp / "merged")),
        ("--to-peft", str(tmp / "lora"), "--out", str(tmp / "peft")),
        ("--from-peft", str(tmp / "peft"), "--base", str(tmp / "ck"), "--out", str(tmp / "from-peft")),
        ("--to-hf", str(tmp / "lora"), "--out", str(tmp / "hf-lora")),
    ):
        assert run_cli("convert", *argv, *ONE) == 0, argv
        _carried(Path(argv[-1]), tmp / "hf")
    assert "the LoRA adapters merged" in capsys.readouterr().out
    tok = checkpoint_tokenizer(tmp / "merged")  # generate's and DPO's: the BPE and its template, not bytes
    assert tok.kind == "hf" and "chat template" in renderer_for(tok).rule
    _, got = hf_weights.load_hf(tmp / "hf-lora")
    _, merged, _ = load_model(tmp / "merged", mesh)  # W + (alpha / R) A B, by --merge
    want = {k: np.asarray(v) for k, v in flat_params(merged).items()}
    _, plain = hf_weights.load_hf(tmp / "hf")
    assert want.keys() == got.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert any(not np.array_equal(plain[k], got[k]) for k in got)  # the adapters are in the export
