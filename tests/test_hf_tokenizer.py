"""Real tokenizers end to end: a tiny random Llama / GPT-J from transformers with a trained BPE
tokenizer.json converts, and `meshlm generate` prints exactly transformers' greedy text on any mesh;
the export loads with AutoTokenizer; a model directory without a tokenizer is said to take ids only."""

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers import run_cli  # noqa: E402

from meshlm.data.bpe import train_bpe  # noqa: E402
from meshlm.data.hf_tokenizer import EOD_TOKEN  # noqa: E402

VOCAB = 320
CORPUS = [
    "def héllo(wörld):\n    return wörld + 1  # ünïcode 日本語\n" * 30,
    "import os\nclass A:\n    pass\n" * 20,
]
PROMPT = "def héllo(w"
NEW = 12
HF_CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        bos_token_id=0,
        eos_token_id=0,
    ),
    "gptj": lambda: transformers.GPTJConfig(
        vocab_size=VOCAB,
        n_embd=64,
        n_layer=2,
        n_inner=256,
        n_head=8,
        rotary_dim=4,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
    ),
}
MODEL_CLASSES = {"llama": "LlamaForCausalLM", "gptj": "GPTJForCausalLM"}


@pytest.fixture(scope="module")
def hf_tokenizer():
    bpe = train_bpe(CORPUS, VOCAB)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=bpe.tok, eos_token=EOD_TOKEN)


@pytest.fixture(scope="module", params=list(HF_CONFIGS))
def converted(request, hf_tokenizer, tmp_path_factory):
    """(model directory, converted checkpoint, transformers' greedy continuation of PROMPT)."""
    torch.manual_seed(0)
    hf_cfg = HF_CONFIGS[request.param]()
    hf_cfg.initializer_range = 0.3  # peaked logits: greedy is neither degenerate nor near a tie
    model = getattr(transformers, MODEL_CLASSES[request.param])(hf_cfg).eval()
    root = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(root / "hf")
    hf_tokenizer.save_pretrained(root / "hf")
    assert (
        run_cli("convert", "--from-hf", str(root / "hf"), "--out", str(root / "ckpt"), "--mesh", "1x1") == 0
    )
    ids = hf_tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    text = hf_tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert len(text) > 3
    return root / "hf", root / "ckpt", text


# 1x1 quick; 1x2 and 2x2 slow: sharded generation equals unsharded (tests/test_generate.py, quick)
@pytest.mark.parametrize(
    "mesh", ["1x1", pytest.param("1x2", marks=pytest.mark.slow), pytest.param("2x2", marks=pytest.mark.slow)]
)
def test_generate_prints_transformers_text(converted, mesh, capsys):
    _, ckpt, want = converted
    capsys.readouterr()
    argv = ["generate", "--checkpoint", str(ckpt), "--mesh", mesh, "--temperature", "0"]
    assert run_cli(*argv, "--prompt", PROMPT, "--max-new-tokens", str(NEW)) == 0
    assert capsys.readouterr().out == PROMPT + want + "\n"


@pytest.mark.parametrize("converted", ["llama"], indirect=True)  # the same commands for both families
def test_stop_string_and_export_loads_with_auto_tokenizer(converted, hf_tokenizer, tmp_path, capsys):
    hf_dir, ckpt, want = converted
    stop = want[len(want) // 2 : len(want) // 2 + 2]
    capsys.readouterr()
    argv = ["generate", "--checkpoint", str(ckpt), "--mesh", "1x2", "--json", "--prompt", PROMPT]
    assert run_cli(*argv, "--max-new-tokens", str(NEW), "--stop", stop) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["finish_reason"] == "stop" and result["text"] == want[: want.index(stop)]
    assert run_cli("convert", "--to-hf", str(ckpt), "--out", str(tmp_path / "export"), "--mesh", "1x1") == 0
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    assert exported(PROMPT).input_ids == hf_tokenizer(PROMPT).input_ids
    assert exported.eos_token == EOD_TOKEN
    assert json.loads((tmp_path / "export" / "config.json").read_text())["eos_token_id"] == 0


@pytest.mark.parametrize("converted", ["gptj"], indirect=True)
def test_model_without_tokenizer_takes_ids_only(converted, tmp_path, capsys):
    hf_dir, _, want = converted
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((hf_dir / name).read_bytes())
    capsys.readouterr()
    assert run_cli("convert", "--from-hf", str(bare), "--out", str(tmp_path / "ckpt"), "--mesh", "1x1") == 0
    assert (
        "tokenizer: none (no tokenizer.json in the model directory): the model can only take token ids"
        in (capsys.readouterr().out)
    )
    argv = ["generate", "--checkpoint", str(tmp_path / "ckpt"), "--mesh", "1x1", "--temperature", "0"]
    assert run_cli(*argv, "--prompt", "x") == 2
    assert "has no tokenizer" in capsys.readouterr().err
    # Given the tokenizer it was made with, it generates what the converted-with-tokenizer one does.
    assert run_cli(*argv, "--prompt", PROMPT, "--max-new-tokens", str(NEW), "--tokenizer", str(hf_dir)) == 0
    assert capsys.readouterr().out == PROMPT + want + "\n"
    assert run_cli(*argv, "--prompt", "x", "--tokenizer", "bytes") == 0  # 320 ids take bytes
    _, ckpt, _ = converted
    assert run_cli("generate", "--checkpoint", str(ckpt), "--prompt", "x", "--tokenizer", "bytes") == 2
    assert "differs from the tokenizer checkpoint" in capsys.readouterr().err
