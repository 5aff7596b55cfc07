"""Fine-tuning a converted model: ``meshlm train --checkpoint`` trains the checkpoint's own model (no preset
is needed or matched) with the tokenizer ``convert --from-hf`` copied next to it. A tiny random model of
each family (transformers, no download) with a 300-id BPE tokenizer in a 320-row vocabulary is converted,
fine-tuned for 2 steps (families rotated over the meshes 1x1, 1x2, 2x1, ``--pp 2`` and ``--cp 2``), then
evaluated and sampled from by ``meshlm eval`` and ``meshlm generate``. ``--config`` with a checkpoint is
refused unless it names the checkpoint's model, in one line listing the fields that differ."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
from helpers import run_cli  # noqa: E402

from meshlm.data.bpe import train_bpe  # noqa: E402
from meshlm.data.hf_tokenizer import EOD_TOKEN  # noqa: E402
from meshlm.io import hf_weights  # noqa: E402
from meshlm.io.model_io import load_model, read_config  # noqa: E402
from meshlm.model.config import get_config  # noqa: E402
from meshlm.parallel.mesh import make_mesh  # noqa: E402
from meshlm.train.config import TrainConfig  # noqa: E402
from meshlm.train.tokenizers import checkpoint_tokenizer  # noqa: E402

VOCAB, TOKENS = 320, 300  # the model's rows, the tokenizer's ids: as in docs/training.md's example
CORPUS = [
    "def héllo(wörld):\n    return wörld + 1  # ünïcode 日本語\n" * 30,
    "import os\nclass A:\n    pass\n" * 20,
]
TEXT = "def héllo(x):\n    return x + 1  # ünïcode\n" * 40  # my.txt
LR = 1e-3  # AdamW moves each weight by about lr per step: the fine-tuned weights stay within 2 lr
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, intermediate_size=64)
SHAPE.update(max_position_embeddings=64, bos_token_id=0, eos_token_id=0)
HEADS = dict(num_attention_heads=4, num_key_value_heads=2)
CP = "--cp 2 --mesh 1x1"
# family: (its transformers config, the training mesh flags). Two layers split into --pp 2 stages; 16
# tokens into --cp 2's 2 x cp chunks; mistral's window (no --cp with a window yet) is inside the sequence.
FAMILIES = {
    "llama": (lambda: transformers.LlamaConfig(**SHAPE, **HEADS), "--pp 2 --mesh 1x1"),
    "qwen2": (lambda: transformers.Qwen2Config(**SHAPE, **HEADS, tie_word_embeddings=True), CP),
    "mistral": (lambda: transformers.MistralConfig(**SHAPE, **HEADS, sliding_window=8), "--mesh 1x2"),
    "gemma": (lambda: transformers.GemmaConfig(**SHAPE, **HEADS, head_dim=8), "--mesh 1x1"),
    "gptj": (
        lambda: transformers.GPTJConfig(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_inner=64, n_head=4, rotary_dim=4, n_positions=64,
            bos_token_id=0, eos_token_id=0,
        ),
        "--mesh 2x1",
    ),
}  # fmt: skip
CLASSES = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral", "gemma": "Gemma", "gptj": "GPTJ"}


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=train_bpe(CORPUS, TOKENS).tok, eos_token=EOD_TOKEN
    )


def _convert(family: str, tokenizer, root) -> str:
    torch.manual_seed(0)
    model = getattr(transformers, f"{CLASSES[family]}ForCausalLM")(FAMILIES[family][0]())
    model.save_pretrained(root / "hf")
    tokenizer.save_pretrained(root / "hf")
    assert run_cli("convert", "--from-hf", str(root / "hf"), "--out", str(root / "ck"), "--mesh", "1x1") == 0
    return str(root / "ck")


def _flat(path) -> dict:
    _, params, _ = load_model(path, make_mesh(1, 1))
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(params)}


# slow: fine-tuning a converted checkpoint, then eval and generate, per family (their cost is their
# scale); the same path runs quick in tests/test_docs_commands.py (finetuning.md's commands on a converted
# Qwen3), each family's reader in its transformers comparison
@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_fine_tune_a_converted_model_then_eval_and_generate(family, tokenizer, tmp_path, capsys):
    ck = _convert(family, tokenizer, tmp_path)
    (tmp_path / "my.txt").write_text(TEXT)
    flags = (
        f"--steps 2 --batch-size 4 --seq-len 16 --lr {LR} --warmup-steps 1 --eval-batches 1 --sample-tokens 0"
    )
    argv = ["train", "--checkpoint", ck, "--data", str(tmp_path / "my.txt"), "--out", str(tmp_path / "ft")]
    capsys.readouterr()
    assert run_cli(*argv, *flags.split(), *FAMILIES[family][1].split()) == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    assert f"model: the model of --checkpoint {ck}, a {family} of 2 layers, d_model 32" in err, err
    ft = str(tmp_path / "ft")
    # The fine-tuned run is the converted model (config, tokenizer), its weights moved from the converted
    # ones by the two steps only (a fresh initialisation would differ by ~0.1).
    assert read_config(ft)[0] == read_config(ck)[0]
    assert checkpoint_tokenizer(ft).fingerprint == checkpoint_tokenizer(ck).fingerprint
    before, after = _flat(ck), _flat(ft)
    moved = max(float(np.max(np.abs(after[k] - before[k]))) for k in before)
    assert 0 < moved <= 2.5 * LR, moved

    # Resuming needs the same --checkpoint (the model is its): without it, one line saying so.
    again = [a for a in argv if a not in ("--checkpoint", ck)]
    assert run_cli(*again, *flags.replace("--steps 2", "--steps 3").split()) == 2
    err = capsys.readouterr().err
    assert f"fine-tunes the model of --checkpoint {ck}; pass --checkpoint {ck} again" in err, err

    mesh = FAMILIES[family][1].split()[-1]  # eval and generate have no pipeline; --cp stays out too
    assert (
        run_cli("eval", "--checkpoint", ft, "--data", str(tmp_path / "my.txt"), "--mesh", mesh, "--json") == 0
    )
    result = json.loads(capsys.readouterr().out)
    tokens = len(tokenizer(TEXT).input_ids) + 1  # the file, then its end-of-document token
    assert result["tokens"] == tokens and result["bytes"] == len(TEXT.encode()) + 1
    assert 0 < result["bits_per_byte"] < np.log2(VOCAB) * tokens / result["bytes"] * 2
    argv = ["generate", "--checkpoint", ft, "--prompt", "def ", "--max-new-tokens", "3", "--temperature", "0"]
    assert run_cli(*argv, "--mesh", mesh, "--json") == 0
    out = json.loads(capsys.readouterr().out)
    assert 1 <= len(out["tokens"]) <= 3 and out["finish_reason"] in ("length", "eod"), out


def test_config_with_a_checkpoint_must_name_its_model(tokenizer, tmp_path, capsys):
    """A --config other than the checkpoint's model: one line naming each field that differs, before the
    data is read or --out is made; the preset the checkpoint equals is accepted (a converted tiny-lm)."""
    ck = _convert("llama", tokenizer, tmp_path)
    argv = ["train", "--checkpoint", ck, "--config", "tiny-llama", "--data", str(tmp_path / "none.txt")]
    capsys.readouterr()
    assert run_cli(*argv, "--out", str(tmp_path / "ft"), "--mesh", "1x1") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"meshlm: error: --config tiny-llama is not the model of --checkpoint {ck} (")
    assert "vocab_size 64 vs 320; d_model 64 vs 32; d_ff 128 vs 64" in err and "leave out --config" in err
    assert not (tmp_path / "ft").exists()

    from meshlm.train.run import run_model

    cfg = get_config("tiny-lm")
    rng = np.random.default_rng(0)
    flat = {p: rng.normal(0, 0.05, s).astype(d) for p, (s, d) in hf_weights.expected_shapes(cfg).items()}
    hf_weights.save_hf(cfg, flat, tmp_path / "tiny-lm-hf")
    assert (
        run_cli(
            "convert",
            "--from-hf",
            str(tmp_path / "tiny-lm-hf"),
            "--out",
            str(tmp_path / "t"),
            "--mesh",
            "1x1",
        )
        == 0
    )
    for config in ("", "tiny-lm"):
        tcfg, model = run_model(TrainConfig(checkpoint=str(tmp_path / "t"), config=config))
        assert model == cfg and tcfg.seq_len == cfg.max_seq_len == 64 and tcfg.config == config
