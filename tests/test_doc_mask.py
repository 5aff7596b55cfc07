"""Document-masked packing (``--doc-mask``): attention never crosses an end-of-document token inside a
window and positions restart at each document, so the per-token losses of a packed window equal those
of its documents run one by one through the plain model (float64, 1e-12: a check independent of the
mask's code); ``verify --doc-mask``'s proof passes on EOD-rich batches with its controls detected, and
fails when the mask changes nothing; ``train --doc-mask`` records it in the checkpoint's model config."""

from __future__ import annotations

import haiku as hk
import jax
import numpy as np
import pytest
from helpers import run_cli, write_corpus

from meshlm.errors import ConfigError
from meshlm.io.model_io import read_config
from meshlm.model import transformer
from meshlm.model.config import get_config
from meshlm.model.layers import mask_vocab_padding, vocab_parallel_xent
from meshlm.model.transformer import init_fn, local_logits
from meshlm.parallel.context import Parallel
from meshlm.parallel.layout import Layout
from meshlm.proof import format_report, model_problem, verify
from meshlm.proof.controls import CONTROLS
from meshlm.proof.documents import document_batch

EOD = 0


def _per_token(cfg):
    def per_token(inputs, targets):
        par = Parallel()
        logits, _ = local_logits(cfg, par, inputs)
        return vocab_parallel_xent(par, mask_vocab_padding(par, logits, cfg.vocab_size), targets)

    return jax.jit(hk.without_apply_rng(hk.transform(per_token)).apply)


def _packed(rng, lengths: list[int], vocab: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """(stream of T + 1 tokens: a window starting inside its first document, the documents separated
    by EOD, one token after the window; the documents' token lists)."""
    docs = [rng.integers(1, vocab, n) for n in lengths]
    stream = [docs[0]] + [p for d in docs[1:] for p in (np.array([EOD]), d)] + [rng.integers(1, vocab, 1)]
    return np.concatenate(stream), docs


def _one_by_one(plain, params, stream: np.ndarray, docs: list[np.ndarray]) -> np.ndarray:
    """Each document alone through the plain (unmasked) model: its inputs from the EOD before it (the
    first one from the window start), its targets up to the token after it. One row per document,
    padded at the end (a causal model's earlier positions never see the padding)."""
    t = len(stream) - 1
    x, y, spans, lo = np.zeros((3, t), np.int64), np.zeros((3, t), np.int64), [], 0
    for row, d in enumerate(docs):
        hi = lo + len(d) + (lo > 0)  # the EOD before it, then the document
        x[row, : hi - lo], y[row, : hi - lo] = stream[lo:hi], stream[lo + 1 : hi + 1]
        spans.append(hi - lo)
        lo = hi
    losses = np.asarray(plain(params, x, y))
    return np.concatenate([losses[row, :n] for row, n in enumerate(spans)])


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gptj"])
def test_packed_window_equals_documents_one_by_one(preset):
    with jax.enable_x64(True):
        cfg = get_config(preset)
        masked, plain = _per_token(cfg.replace(doc_mask=EOD)), _per_token(cfg)
        init, example = init_fn(cfg)
        params = jax.tree.map(lambda p: p.astype(np.float64), init(jax.random.PRNGKey(0), example))
        rng = np.random.default_rng(0)
        for lengths in ([5, 7, 4], [1, 1, 14], [18]):  # windows of 18 tokens
            stream, docs = _packed(rng, lengths, cfg.vocab_size)
            got = np.asarray(masked(params, stream[None, :-1], stream[None, 1:]))[0]
            want = _one_by_one(plain, params, stream, docs)
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)
            unmasked = np.asarray(plain(params, stream[None, :-1], stream[None, 1:]))[0]
            if len(docs) > 1:  # the control: without the mask, later documents see earlier ones
                assert np.max(np.abs(unmasked - want) / want) > 1e-3


def test_document_batch_is_eod_rich_and_deterministic():
    batch = document_batch(64, EOD, (4, 32), seed=1)
    inputs = batch["inputs"]
    assert inputs.shape == (4, 32) and np.array_equal(inputs[:, 1:], batch["targets"][:, :-1])
    assert ((inputs == EOD).sum(axis=1) >= 3).all()  # several documents in every row
    assert len({tuple(np.flatnonzero(r == EOD)) for r in inputs}) == 4  # boundaries differ per row
    assert np.array_equal(inputs, document_batch(64, EOD, (4, 32), seed=1)["inputs"])
    assert document_batch(64, EOD, (2, 3, 8), seed=1)["inputs"].shape == (2, 3, 8)  # accumulation


LAYOUT = Layout(dp=2, mp=2, fsdp=True, sp=True)
DOC_CONTROLS = tuple(c for c in CONTROLS if c.name.startswith("document mask"))


@pytest.fixture(scope="module")
def doc_problem():
    cfg = get_config("tiny-llama").replace(doc_mask=EOD)
    return model_problem(cfg, "tiny-llama", mp=2, batch_size=4, seq_len=16, dp=2, fsdp=True, sp=True)


def test_verify_doc_mask_passes_and_its_controls_are_detected(doc_problem):
    """``meshlm verify --doc-mask``'s proof on 2x2 with FSDP and SP, float64: sharded == unsharded
    on EOD-rich batches, and each planted mask fault (and the mask switched off) is detected."""
    with jax.enable_x64(True):
        report = verify(doc_problem, LAYOUT, dtype=np.float64, controls=DOC_CONTROLS)
    assert report.ok, format_report(report)
    assert max(p.max_rel_err for p in report.params) <= 1e-12
    assert [c["name"] for c in report.controls] == [c.name for c in DOC_CONTROLS]
    for c in report.controls:
        assert c["detected"] and c["margin"] > 1e6, c  # far beyond the tolerance


def test_verify_doc_mask_fails_when_the_mask_changes_nothing(doc_problem, monkeypatch):
    """The planted bug: the model's mask does nothing (every document starts at 0). Sharded still
    equals unsharded, but the control *document mask off* is not detected, so the proof fails."""
    monkeypatch.setattr(transformer, "doc_starts", lambda tokens, eod: jax.numpy.zeros_like(tokens))
    off = tuple(c for c in DOC_CONTROLS if "off" in c.name)
    with jax.enable_x64(True):
        report = verify(doc_problem, LAYOUT, dtype=np.float64, controls=off)
    assert report.loss_ok and not report.ok
    assert report.controls[0]["detected"] is False


def test_doc_mask_config_is_checked():
    with pytest.raises(ConfigError, match="doc_mask=.* needs attention"):
        get_config("tiny").replace(doc_mask=0)  # the ff family has no attention
    with pytest.raises(ConfigError, match="doc_mask=64 needs attention and an id below vocab_size"):
        get_config("tiny-llama").replace(doc_mask=64)


def test_train_doc_mask_is_recorded_in_the_checkpoint(tmp_path, capsys):
    (tmp_path / "c").mkdir()
    out = tmp_path / "run"
    argv = ["train", "--data", write_corpus(tmp_path / "c"), "--config", "tiny-lm", "--steps", "1"]
    argv += ["--batch-size", "2", "--seq-len", "16", "--eval-batches", "1", "--sample-tokens", "4"]
    argv += ["--mesh", "1x2", "--doc-mask", "--out", str(out)]
    assert run_cli(*argv) == 0, capsys.readouterr().err
    assert read_config(out)[0].doc_mask == EOD  # the byte tokenizer's EOD
    assert run_cli(*argv[:-3], "--out", str(out)) == 2  # resuming without it is refused
    assert "doc_mask: saved True, now False" in capsys.readouterr().err
