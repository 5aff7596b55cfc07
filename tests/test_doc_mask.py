"""Document-masked packing (``--doc-mask``): attention never crosses an end-of-document token inside a
window and positions restart at each document, so the per-token losses of a packed window equal those
of its documents run one by one through the plain model (float64, 1e-12: a check independent of the
mask's code); sharded equals unsharded with the mask (float64), and a mask that ignores one boundary
is caught; ``train --doc-mask`` records it in the checkpoint's model config."""

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
from meshlm.model.transformer import init_fn, local_logits, loss_fn
from meshlm.parallel.context import Parallel
from meshlm.parallel.layout import Layout
from meshlm.sharding.spmd import reference_value_and_grad, sharded_value_and_grad
from meshlm.train.step import init_model

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


def _eod_rich_batch(cfg, seed: int, b: int = 4, t: int = 32) -> dict:
    tokens = np.random.default_rng(seed).integers(0, 6, (b, t + 1))  # ids < 6: about one EOD in six
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _ignore_first_boundary(tokens, eod):
    """A faulty mask for the control: the first EOD of each row does not start a document."""
    t = jax.numpy.arange(tokens.shape[-1])
    is_eod = tokens == eod
    first_eod = jax.numpy.argmax(is_eod, axis=-1)[:, None]
    kept = is_eod & (t[None, :] != first_eod)
    return t - jax.lax.cummax(jax.numpy.where(kept, t, 0), axis=tokens.ndim - 1)


@pytest.mark.parametrize("sp", [False, True])
def test_sharded_equals_unsharded_with_the_mask_and_a_faulty_mask_is_caught(sp, monkeypatch):
    with jax.enable_x64(True):
        cfg = get_config("tiny-llama").replace(doc_mask=EOD)
        layout = Layout(dp=2, mp=2, sp=sp)
        params, specs = init_model(cfg, layout, 0, dtype=np.float64)
        batch = _eod_rich_batch(cfg, 1)
        build = lambda par: loss_fn(cfg, par)
        want_loss, want_grads = jax.jit(reference_value_and_grad(build))(jax.device_get(params), batch)

        def worst(loss, grads) -> float:
            errs = [abs(float(loss) - float(want_loss)) / abs(float(want_loss))]
            for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
                errs.append(float(np.max(np.abs(np.asarray(g) - w)) / max(np.max(np.abs(w)), 1e-300)))
            return max(errs)

        got = jax.jit(sharded_value_and_grad(build, layout, specs))(params, batch)
        assert worst(*got) <= 1e-12
        monkeypatch.setattr(transformer, "doc_positions", _ignore_first_boundary)
        faulty = jax.jit(sharded_value_and_grad(build, layout, specs))(params, batch)
        assert worst(*faulty) > 1e-6  # the control is detected


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
