"""LoRA interop: a LoRA checkpoint of a tiny random Qwen3 (built by transformers, converted) exported by
``convert --to-peft`` loads with ``peft.PeftModel.from_pretrained`` onto the transformers base with
logits within 1e-5 of meshlm's adapted model; ``--from-peft`` imports it back bit for bit; ``--merge``
writes weights whose plain forward is the adapted one."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import jax  # noqa: E402
from helpers import run_cli, save_lora_run  # noqa: E402
from hf_helpers import RTOL, VOCAB, hf_logits, our_logits, perturbed_model, random_tokens, rel  # noqa: E402

from meshlm.io import hf_weights  # noqa: E402
from meshlm.io.model_io import load_model, save_model  # noqa: E402
from meshlm.model import lora  # noqa: E402
from meshlm.model.params import flat_params, unflatten  # noqa: E402

TARGETS = "q,k,v,o,gate,up,down"
ONE = ("--mesh", "1x1")  # every command on one device


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(the transformers base, the meshlm base and LoRA checkpoints' directory, the adapted config,
    its flat parameters): adapters drawn at random (B != 0)."""
    tmp = tmp_path_factory.mktemp("peft")
    hf_cfg = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, intermediate_size=64, bos_token_id=0,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4}, eos_token_id=0,
    )  # fmt: skip
    model = perturbed_model(transformers.Qwen3ForCausalLM, hf_cfg)
    model.save_pretrained(tmp / "hf")
    cfg, flat = hf_weights.load_hf(tmp / "hf")
    base = unflatten({k: jax.numpy.asarray(v) for k, v in flat.items()})
    save_model(tmp / "base", cfg, base)
    cfg = cfg.replace(lora_rank=4, lora_alpha=8.0, lora_targets=TARGETS)
    adapters = save_lora_run(cfg, base, tmp / "lora", tmp / "base", seed=7)
    return model, tmp, cfg, flat_params(lora.combine(base, adapters))


def test_to_peft_loads_in_peft_with_equal_logits_and_imports_back(setup):
    model, tmp, cfg, flat = setup
    assert run_cli("convert", "--to-peft", str(tmp / "lora"), "--out", str(tmp / "peft"), *ONE) == 0
    tokens = random_tokens()
    ours = our_logits(cfg, flat, tokens)
    base_only = hf_logits(model, tokens)
    adapted = peft.PeftModel.from_pretrained(model, str(tmp / "peft")).eval()
    theirs = hf_logits(adapted, tokens)
    assert rel(theirs, ours) <= RTOL, rel(theirs, ours)
    assert rel(base_only, ours) > 1e-2  # the adapters change the logits: the check has teeth
    argv = [
        "convert",
        "--from-peft",
        str(tmp / "peft"),
        "--base",
        str(tmp / "base"),
        "--out",
        str(tmp / "back"),
    ]
    assert run_cli(*argv, *ONE) == 0
    mesh = jax.make_mesh((1, 1), ("dp", "mp"), devices=jax.devices()[:1])
    back_cfg, back, _ = load_model(tmp / "back", mesh)
    assert back_cfg == cfg
    for path, value in flat_params(lora.adapters(back)).items():
        np.testing.assert_array_equal(np.asarray(value), np.asarray(flat[path]), err_msg=path)


def test_merge_writes_weights_whose_plain_forward_is_the_adapted_one(setup, capsys):
    _, tmp, cfg, flat = setup
    assert run_cli("convert", "--merge", str(tmp / "lora"), "--out", str(tmp / "merged"), *ONE) == 0
    mesh = jax.make_mesh((1, 1), ("dp", "mp"), devices=jax.devices()[:1])
    plain, merged, _ = load_model(tmp / "merged", mesh)
    assert not plain.lora_rank
    tokens = random_tokens()
    assert (
        rel(
            our_logits(plain, {k: np.asarray(v) for k, v in flat_params(merged).items()}, tokens),
            our_logits(cfg, flat, tokens),
        )
        <= RTOL
    )
    capsys.readouterr()
    assert run_cli("convert", "--merge", str(tmp / "base"), "--out", str(tmp / "m2"), *ONE) == 2
    assert "not a LoRA checkpoint" in capsys.readouterr().err


def _same_chat_template(directory, want) -> None:
    """``AutoTokenizer`` of ``directory`` renders (text and ids) and names its special tokens as
    ``want`` (the original's) does."""
    got = transformers.AutoTokenizer.from_pretrained(directory)
    chat = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5."}]
    for messages, prompt in ((chat, False), (chat[:1], True)):
        for tokenize in (False, True):
            kw = {"tokenize": tokenize, "add_generation_prompt": prompt}
            assert got.apply_chat_template(messages, **kw) == want.apply_chat_template(messages, **kw), (
                directory
            )
    assert (got.eos_token, got.pad_token) == (want.eos_token, want.pad_token), directory


# slow: a chat model converted, LoRA-trained and exported every way, its cost (five conversions and a
# training run); the file carrying of each path: tests/test_convert_carry.py, quick
@pytest.mark.slow
def test_chat_model_converted_fine_tuned_and_exported_keeps_its_template_and_its_adapters(tmp_path):
    """A transformers Qwen3 with a ChatML chat_template.jinja: converted, its chat data prepared with
    the checkpoint as --tokenizer, LoRA-trained; --to-hf exports the adapted model (merged: logits
    those of peft on the transformers base and of meshlm's adapted model), and every export
    (--to-hf, --to-peft, --merge then --to-hf, --from-peft) has the original's chat template."""
    from helpers import run_cli
    from test_chat_sft import CONVERSATIONS, EXAMPLES, chat_tokenizer_dir

    chat_tokenizer_dir(tmp_path / "hf", (EXAMPLES / "chatml.jinja").read_text())
    original = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    hf_cfg = transformers.Qwen3Config(
        vocab_size=320, hidden_size=32, num_hidden_layers=2, intermediate_size=64, head_dim=16,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4}, eos_token_id=original.eos_token_id,
    )  # fmt: skip
    model = perturbed_model(transformers.Qwen3ForCausalLM, hf_cfg)
    model.save_pretrained(tmp_path / "hf")
    assert (tmp_path / "hf" / "chat_template.jinja").is_file()  # transformers 5's layout
    d = {
        name: str(tmp_path / name)
        for name in ("ck", "chat", "run", "hf-run", "peft", "sft", "hf-sft", "back")
    }
    assert run_cli("convert", "--from-hf", str(tmp_path / "hf"), "--out", d["ck"], *ONE) == 0
    prepare = ["data", "prepare", "--chat", "--tokenizer", d["ck"], "--data", str(CONVERSATIONS)]
    assert run_cli(*prepare, "--seq-len", "128", "--val-fraction", "0.2", "--out", d["chat"]) == 0
    train = [
        "train",
        "--checkpoint",
        d["ck"],
        "--data",
        d["chat"],
        "--lora-rank",
        "4",
        "--lora-targets",
        TARGETS,
    ]
    fast = ["--seq-len", "128", "--steps", "2", "--batch-size", "4", "--lr", "0.05", "--warmup-steps", "1"]
    assert run_cli(*train, *fast, "--eval-every", "0", "--sample-tokens", "0", "--out", d["run"], *ONE) == 0
    for argv in (
        ("--to-hf", d["run"], "--out", d["hf-run"]),
        ("--to-peft", d["run"], "--out", d["peft"]),
        ("--merge", d["run"], "--out", d["sft"]),
        ("--to-hf", d["sft"], "--out", d["hf-sft"]),
        ("--from-peft", d["peft"], "--base", d["ck"], "--out", d["back"]),
    ):
        assert run_cli("convert", *argv, *ONE) == 0, argv
    for name in ("ck", "run", "hf-run", "peft", "sft", "hf-sft", "back"):
        _same_chat_template(d[name], original)
    mesh = jax.make_mesh((1, 1), ("dp", "mp"), devices=jax.devices()[:1])
    cfg, params, _ = load_model(d["run"], mesh)
    tokens = random_tokens()
    ours = our_logits(cfg, {k: np.asarray(v) for k, v in flat_params(params).items()}, tokens)
    assert rel(hf_logits(model, tokens), ours) > 1e-3  # the trained adapters change the logits
    adapted = peft.PeftModel.from_pretrained(model, d["peft"]).eval()
    for theirs in (
        adapted,
        *(transformers.AutoModelForCausalLM.from_pretrained(d[n]) for n in ("hf-run", "hf-sft")),
    ):
        assert rel(hf_logits(theirs.eval(), tokens), ours) <= RTOL
