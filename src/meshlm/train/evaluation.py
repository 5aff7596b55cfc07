"""``meshlm eval``: a model's loss on a whole data set, every token predicted exactly once.

The set is a token stream (each document then EOD: raw text, record files or one split of a token
store). Preceded by one EOD, as every document in training is, the stream is cut into
non-overlapping windows of ``seq_len`` tokens: window k's inputs are tokens [kT - 1, kT + T - 1) of
that stream and its targets the next T, so every token of the set (EOD included) is a target exactly
once, the last, partial window too (its padding is masked out). Each window is read without the
context of the previous one: the standard non-overlapping evaluation, no sampling.

Reported: the loss (mean nats per target token, z-loss excluded), perplexity exp(loss), and bits per
byte: the summed loss / ln 2 / the UTF-8 bytes of the targets (``Tokenizer.token_bytes``, EOD one
byte), comparable across tokenizers. Windows run ``batch_size`` at a time, rows over dp, the model
split over mp as in training; per-token losses come back to the host and are summed in float64.
With ``--cp N`` each window's sequence is split over cp as in training (each shard its two
load-balanced chunks, ``parallel.cp``); the per-token losses come back from every cp shard and are put
in sequence order before they reach the host, so every token is counted once, where it is.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import jax
import numpy as np

from meshlm.data.corpus import load_all
from meshlm.data.store import store_arg
from meshlm.data.stream import TokenStream
from meshlm.data.tokenizer import Tokenizer
from meshlm.data.tokens import check_token_range
from meshlm.errors import ConfigError
from meshlm.generate.generator import as_run_here
from meshlm.io.model_io import load_model, read_config
from meshlm.model.config import ModelConfig, default_seq_len
from meshlm.parallel import distributed
from meshlm.parallel.layout import Layout
from meshlm.parallel.placement import batch_sharding, put_global, to_host
from meshlm.train.eval_settings import EvalConfig, check_split


@dataclass(frozen=True, kw_only=True)
class EvalResult:
    """What ``evaluate_stream`` measured. ``per_token``: every target's loss in stream order (only when
    asked for: it is as long as the set)."""

    tokens: int  # targets scored: every token of the set, EOD included
    bytes: int  # their UTF-8 bytes (EOD: 1)
    loss: float  # mean nats per token
    windows: int  # windows of seq_len evaluated (the last may be partial)
    seq_len: int
    per_token: np.ndarray | None = None

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.loss < 700 else math.inf

    @property
    def bits_per_byte(self) -> float:
        return self.loss * self.tokens / math.log(2) / max(1, self.bytes)

    def to_json(self) -> dict:
        keys = ("tokens", "bytes", "loss", "perplexity", "bits_per_byte", "windows", "seq_len")
        return {k: getattr(self, k) for k in keys}


def per_token_loss_fn(cfg: ModelConfig, layout: Layout, params):
    """jitted (params, {"inputs", "targets": [B, T]}) -> per-token cross-entropy [B, T] (no z-loss), on
    ``layout``: rows over dp, the model as ``params`` are laid out (their shardings' specs); with cp
    the sequence split over cp as in training and the losses put back in sequence order
    (``train.dpo.per_token_logps``, negated: DPO's sums read the same program)."""
    from meshlm.train.dpo import per_token_logps

    specs = jax.tree.map(lambda p: p.sharding.spec, params)
    logps = per_token_logps(cfg.replace(z_loss=0.0), layout, specs)
    return jax.jit(lambda p, batch: -logps(p, batch))


def windows(tokens: np.ndarray, eod_id: int, seq_len: int, batch: int) -> Iterator[dict[str, np.ndarray]]:
    """Batches of ``batch`` windows (see the module doc): {"inputs", "targets": int32 [batch, T],
    "mask": bool [batch, T]}; padding (the last window's tail, whole windows at the end) is masked."""
    n, t = len(tokens), seq_len
    count = -(-n // t)
    for first in range(0, count, batch):
        inputs = np.full((batch, t), eod_id, np.int32)
        targets = np.zeros((batch, t), np.int32)
        mask = np.zeros((batch, t), bool)
        for row, k in enumerate(range(first, min(first + batch, count))):
            lo, hi = k * t, min(k * t + t, n)
            targets[row, : hi - lo] = tokens[lo:hi]
            mask[row, : hi - lo] = True
            inputs[row, 1 : hi - lo] = tokens[lo : hi - 1]
            inputs[row, 0] = tokens[lo - 1] if k else eod_id
        yield {"inputs": inputs, "targets": targets, "mask": mask}


def _target_mask(trained: np.ndarray, valid: np.ndarray, seq_len: int, batch: int, first_window: int):
    """bool [batch, T]: the loss mask of the windows' targets (``windows``: window k's targets are
    tokens [k T, k T + T)); ``valid`` marks the targets that exist."""
    out = np.zeros_like(valid)
    for row in range(batch):
        lo = (first_window + row) * seq_len
        got = np.asarray(trained[lo : lo + seq_len], bool)
        out[row, : len(got)] = got
    return out


def check_shape(seq_len: int, batch_size: int, cfg: ModelConfig, layout: Layout) -> None:
    if seq_len > cfg.max_seq_len and cfg.arch.attention:
        raise ConfigError(f"--seq-len {seq_len} exceeds the model's max_seq_len={cfg.max_seq_len}; lower it")
    layout.check_batch(batch_size)
    layout.check_seq_len(seq_len)  # with cp: 2 cp chunks per row


def evaluate_stream(
    cfg: ModelConfig,
    params,
    where,
    stream: TokenStream,
    tokenizer: Tokenizer,
    *,
    seq_len: int,
    batch_size: int,
    keep_per_token: bool = False,
    progress: bool = True,
) -> EvalResult:
    """The loss of ``params`` (laid out on ``where``, a Layout or a jax Mesh) over every token of
    ``stream`` (see the module doc)."""
    layout = Layout.of(where)
    check_shape(seq_len, batch_size, cfg, layout)
    n = len(stream)
    if n < 1:
        raise ConfigError("the evaluation set holds no tokens; pass non-empty data")
    fn, sharding = per_token_loss_fn(cfg, layout, params), batch_sharding(layout, 1)
    token_bytes = np.asarray(tokenizer.token_bytes, np.int64)
    total, n_bytes, kept = 0.0, 0, []
    count = -(-n // seq_len)
    bar = _bar(count, progress)
    # A chat store's loss mask (``data.chat_store``): the loss is sum(mask x loss) / sum(mask), over the
    # targets it trains on only (the windows' targets are the stream's tokens, so is its mask)
    trained = stream.loss_mask
    if trained is not None:
        n = int(np.count_nonzero(trained))
        if not n:
            raise ConfigError("the chat store's evaluation split has no trained-on token (loss mask all 0)")
    with bar:
        for i, b in enumerate(windows(stream.tokens, stream.eod_id, seq_len, batch_size)):
            placed = {k: put_global(b[k], sharding) for k in ("inputs", "targets")}
            valid = b["mask"]
            if trained is not None:
                b = {**b, "mask": valid & _target_mask(trained, valid, seq_len, batch_size, i * batch_size)}
            losses = to_host(fn(params, placed)).astype(np.float64)[b["mask"]]
            total += float(losses.sum())
            n_bytes += int(token_bytes[b["targets"][b["mask"]]].sum())
            if keep_per_token:
                kept.append(losses)
            bar.update(int(valid.any(axis=1).sum()))
    per_token = np.concatenate(kept) if keep_per_token else None
    return EvalResult(
        tokens=n, bytes=n_bytes, loss=total / n, windows=count, seq_len=seq_len, per_token=per_token
    )


def eval_tokenizer(ecfg: EvalConfig) -> Tokenizer:
    """The checkpoint's tokenizer; ``ecfg.tokenizer`` only for one converted without any (or the same)."""
    from meshlm.train.tokenizers import checkpoint_or_given

    return checkpoint_or_given(ecfg.checkpoint, ecfg.tokenizer)


def eval_stream(ecfg: EvalConfig, tok: Tokenizer, cfg: ModelConfig) -> tuple[TokenStream, str]:
    """(the evaluation set's tokens, what it is): a store's split, or every document of the paths."""
    check_split(ecfg)
    store = store_arg(ecfg.data)
    if store is not None:
        train, val, info = store.splits(tok, cfg.vocab_size)
        return (train if ecfg.split == "train" else val), f"{info['source']}, {ecfg.split} split"
    stream, source = load_all(list(ecfg.data), tok, ecfg.text_field)
    check_token_range(stream.tokens, cfg.vocab_size, "evaluation data")
    return stream, source


def evaluate(ecfg: EvalConfig, where, *, keep_per_token: bool = False) -> tuple[EvalResult, str]:
    """(the result, the data's description): ``ecfg.checkpoint`` on ``where`` (a Layout or a jax Mesh)
    over ``ecfg.data``."""
    layout = Layout.of(where)
    tok = eval_tokenizer(ecfg)
    cfg, _ = read_config(ecfg.checkpoint)
    seq_len = default_seq_len(cfg, ecfg.seq_len)
    check_shape(seq_len, ecfg.batch_size, cfg, layout)  # before the data and weights load
    stream, source = eval_stream(ecfg, tok, cfg)
    cfg, params, _ = load_model(ecfg.checkpoint, layout)
    cfg = as_run_here(cfg)  # the backend's mixture-of-experts dispatch, not the saved config's
    result = evaluate_stream(
        cfg,
        params,
        layout,
        stream,
        tok,
        seq_len=seq_len,
        batch_size=ecfg.batch_size,
        keep_per_token=keep_per_token,
    )
    return result, source


def _bar(total: int, enabled: bool):
    from tqdm import tqdm

    disable = not (enabled and distributed.is_main())
    return tqdm(total=total, desc="eval", unit="window", file=sys.stderr, disable=disable, dynamic_ncols=True)
