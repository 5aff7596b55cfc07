"""``meshlm eval``: every token of a set predicted once; on a converted Hugging Face model our per-token
losses equal ``transformers``' over the same windows, on any mesh; a store's split evaluates too."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers import run_cli  # noqa: E402

from meshlm.data.stream import TokenStream  # noqa: E402
from meshlm.parallel.mesh import make_mesh  # noqa: E402
from meshlm.train.eval_settings import EvalConfig  # noqa: E402
from meshlm.train.evaluation import evaluate, windows  # noqa: E402

SEQ = 32
TEXT = "def add(a, b):\n    return a + b  # héllo wörld 日本語\n" * 6 + "tail"  # 5.x windows of 32


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(a tiny random Llama of 300 ids, converted to a meshlm checkpoint; the transformers model)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=SEQ,
        vocab_size=300,  # holds the byte tokenizer's 256 ids
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    root = tmp_path_factory.mktemp("eval")
    model.save_pretrained(root / "hf", safe_serialization=True)
    assert run_cli("convert", "--from-hf", str(root / "hf"), "--out", str(root / "ck"), "--mesh", "1x1") == 0
    (root / "text.txt").write_text(TEXT)
    return root, model


def _transformers_losses(model, tokens: np.ndarray) -> np.ndarray:
    """Per-token losses written out independently: the stream after one EOD (0), cut into windows of SEQ
    inputs, each window run alone (the last one unpadded), every token a target once."""
    s = np.concatenate([[0], tokens])
    out = []
    with torch.no_grad():
        for lo in range(0, len(tokens), SEQ):
            inputs, targets = s[lo : lo + SEQ], s[lo + 1 : lo + SEQ + 1]
            logits = model(torch.tensor(inputs[None, : len(targets)])).logits[0].double()
            out.append(-torch.log_softmax(logits, -1)[torch.arange(len(targets)), torch.tensor(targets)])
    return torch.cat(out).numpy()


@pytest.mark.parametrize("mesh_shape", [(1, 1), (2, 2)])
def test_per_token_loss_equals_transformers(converted, mesh_shape):
    root, model = converted
    ecfg = EvalConfig(
        checkpoint=str(root / "ck"), data=(str(root / "text.txt"),), tokenizer="bytes", batch_size=2
    )
    result, _ = evaluate(ecfg, make_mesh(*mesh_shape), keep_per_token=True)
    tokens = np.frombuffer(TEXT.encode() + b"\0", np.uint8).astype(np.int64)  # the file: its bytes, then EOD
    want = _transformers_losses(model, tokens)
    assert result.tokens == len(tokens) == len(result.per_token) and result.windows == math.ceil(
        len(tokens) / SEQ
    )
    np.testing.assert_allclose(result.per_token, want, rtol=1e-5, atol=0)
    assert abs(result.loss - want.mean()) <= 1e-5 * want.mean()
    assert result.bytes == len(tokens) and result.bits_per_byte == pytest.approx(want.mean() / math.log(2))
    assert result.perplexity == pytest.approx(math.exp(want.mean()))


def test_windows_cover_every_token_once():
    tokens = np.arange(1, 12)  # 11 tokens, windows of 4 in batches of 2: 3 windows, 2 batches
    batches = list(windows(tokens, 0, 4, 2))
    targets = np.concatenate([b["targets"][b["mask"]] for b in batches])
    np.testing.assert_array_equal(targets, tokens)
    inputs = np.concatenate([b["inputs"][b["mask"]] for b in batches])
    np.testing.assert_array_equal(inputs, np.concatenate([[0], tokens[:-1]]))  # each target's previous token
    assert len(batches) == 2 and not batches[1]["mask"][1].any()  # a whole padding window, masked


def test_eval_cli_on_a_store(converted, tmp_path, capsys):
    """The CLI (--json) on a token store's validation split, on a 2x2 mesh; errors are one line."""
    root, _ = converted
    store = str(tmp_path / "s")
    argv = ["data", "prepare", "--data", str(root / "text.txt"), "--out", store, "--val-fraction", "0.5"]
    assert run_cli(*argv) == 0
    capsys.readouterr()
    argv = [
        "eval",
        "--checkpoint",
        str(root / "ck"),
        "--data",
        store,
        "--tokenizer",
        "bytes",
        "--mesh",
        "2x2",
    ]
    assert run_cli(*argv, "--json") == 0, capsys.readouterr().err
    captured = capsys.readouterr()
    got = json.loads(captured.out.strip().splitlines()[-1])
    val = TokenStream.from_texts(
        [TEXT.encode()[-round(len(TEXT.encode()) * 0.5) :]],
        __import__("meshlm").data.tokenizer.ByteTokenizer(),
    )
    assert got["tokens"] == len(val) and got["mesh"] == "2x2" and "val split" in got["data"]
    assert "eval" in captured.err and "100%" in captured.err  # the progress bar
    assert run_cli(*argv, "--batch-size", "3") == 2
    assert "not a multiple of dp=2" in capsys.readouterr().err
    assert run_cli(*argv, "--seq-len", "64") == 2
    assert "exceeds the model's max_seq_len=32" in capsys.readouterr().err
    assert run_cli("eval", "--checkpoint", str(root / "ck"), "--data", store, "--mesh", "1x1") == 2
    assert "no tokenizer" in capsys.readouterr().err


def test_bits_per_byte_counts_the_targets_bytes(converted):
    """Bits per byte on a stream whose inputs and targets differ in bytes: a BPE of multi-byte tokens,
    the stream ending in one (no final EOD), so the inputs (EOD, then every token but the last) and the
    targets (every token) differ by the last token's bytes less one. The figure by hand: transformers'
    per-token losses, in bits, over the text's UTF-8 bytes (the targets are the whole text, once).

    Mutant caught (issue 47, round 5): in ``evaluate_stream``, ``token_bytes[b["targets"][b["mask"]]]``
    planted as ``token_bytes[b["inputs"][b["mask"]]]`` (every stream meshlm builds ends in a one-byte
    EOD, where the two totals agree)."""
    from meshlm.data.bpe import train_bpe
    from meshlm.io.model_io import load_model
    from meshlm.parallel.layout import Layout
    from meshlm.train.evaluation import evaluate_stream

    root, model = converted
    tok = train_bpe(TEXT.splitlines(), 300)
    tokens = tok.encode(TEXT).astype(np.int64)
    token_bytes = tok.token_bytes
    assert tok.eod_id == 0 and tok.vocab_size <= 300  # the model's EOD and ids
    assert token_bytes[tokens[-1]] > 1 and tok.eod_id not in tokens  # inputs' bytes != targets'
    n_bytes = len(TEXT.encode())
    assert int(token_bytes[tokens].sum()) == n_bytes != 1 + int(token_bytes[tokens[:-1]].sum())
    cfg, params, _ = load_model(root / "ck", Layout())
    stream = TokenStream(tokens, vocab_size=tok.vocab_size, eod_id=tok.eod_id)
    result = evaluate_stream(cfg, params, Layout(), stream, tok, seq_len=SEQ, batch_size=2, progress=False)
    want = _transformers_losses(model, tokens)
    assert result.bytes == n_bytes and len(tokens) % SEQ  # a partial last window too
    assert result.bits_per_byte == pytest.approx(want.sum() / math.log(2) / n_bytes, rel=1e-5)
