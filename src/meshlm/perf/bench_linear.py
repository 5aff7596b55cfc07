"""``meshlm bench --compare-linear``: a hybrid's two token mixers timed side by side in one run — its
linear-attention layer (Gated DeltaNet, ``model.linear_attention``) against its full-attention layer
(the blockwise kernel, ``model.attention``) — at --seq-len / 16, / 4 and --seq-len (1k, 4k and 16k from
--seq-len 16384), in tokens per second of one layer's forward and backward.

Only the mixer is timed: [B, T, D] in, the layer's output [B, T, D], the gradients of every weight and
of the input (the norms, MLP, embedding and head, the same in both kinds, are left out: they would
dilute the difference). One device, round-robin over all six (``perf.bench.time_interleaved``), so the
machine's noise lands on every row. The linear layer's work is O(T) (its chunked rule: a fixed solve per
chunk of ``linear_chunk`` tokens and a scan over chunks carrying a [dk, dv] state per head), so its
tokens per second stay flat as T grows; causal attention's is O(T^2) (every key block up to the
query's), so its tokens per second fall about as 1/T once the scores dominate.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp

from meshlm.errors import ConfigError
from meshlm.model.config import ModelConfig
from meshlm.model.linear_attention import linear_mixer
from meshlm.model.mla import attention_module
from meshlm.model.transformer import GPT_STDDEV
from meshlm.parallel.context import Parallel
from meshlm.parallel.layout import Layout
from meshlm.perf.bench import time_interleaved
from meshlm.perf.bench_settings import BenchSettings

KINDS = ("linear", "full")
FRACTIONS = (16, 4, 1)  # the lengths timed: --seq-len divided by each


@dataclass
class _Mixer:
    """One mixer at one length: its compiled forward and backward and its inputs (``time_interleaved``
    needs ``name`` and ``step``)."""

    name: str
    compiled: Any
    args: tuple

    def step(self) -> None:
        jax.block_until_ready(self.compiled(*self.args))


def _mixer(cfg: ModelConfig, kind: str, batch: int, seq_len: int, seed: int) -> _Mixer:
    """``kind``'s layer on [batch, seq_len, D] (unsharded: one device), compiled ahead of the timing."""
    par = Parallel()

    def forward(x, positions):
        mix = (
            linear_mixer(cfg, par, GPT_STDDEV) if kind == "linear" else attention_module(cfg, par, GPT_STDDEV)
        )
        return mix(x, positions)[0]

    fn = hk.without_apply_rng(hk.transform(forward))
    x = jax.random.normal(jax.random.PRNGKey(seed), (batch, seq_len, cfg.d_model), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(seq_len), (batch, seq_len))
    params = fn.init(jax.random.PRNGKey(seed), x, positions)
    loss = lambda p, x: jnp.mean(jnp.square(fn.apply(p, x, positions)))  # a scalar to differentiate
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    return _Mixer(f"{kind} {seq_len}", step.lower(params, x).compile(), (params, x))


def check(cfg: ModelConfig, layout: Layout, seq_len: int) -> None:
    """One line before any compile: a hybrid, the blockwise kernel, one device, lengths of >= 1 token."""
    if not cfg.full_attn_every:
        raise ConfigError(
            f"--compare-linear times a hybrid's linear-attention layer, and {cfg.family!r} has none: use "
            "a config with linear layers (tiny-qwen3.5)"
        )
    if cfg.attention != "blockwise":
        raise ConfigError(
            "--compare-linear times full attention by the blockwise kernel: add --attention blockwise"
        )
    if layout.devices > 1:
        raise ConfigError(
            f"--compare-linear times one layer on one device: use --mesh 1x1 (got {layout.shape})"
        )
    if seq_len < FRACTIONS[0]:
        raise ConfigError(
            f"--compare-linear times --seq-len / 16, / 4 and / 1: --seq-len {seq_len} is under 16"
        )


def compare_linear(cfg: ModelConfig, name: str, layout: Layout, settings: BenchSettings) -> dict:
    """Every (kind, length) compiled, then timed round-robin; the JSON-ready report."""
    check(cfg, layout, settings.seq_len)
    lengths = [settings.seq_len // f for f in FRACTIONS]
    batch = settings.batch_size
    mixers = [_mixer(cfg, kind, batch, t, settings.seed) for t in lengths for kind in KINDS]
    seconds, _ = time_interleaved(mixers, settings.steps, settings.warmup, lambda dtype: 0.0)
    rows = []
    for t in lengths:
        median = {kind: statistics.median(seconds[f"{kind} {t}"]) for kind in KINDS}
        rows.append(
            {
                "seq_len": t,
                **{f"{kind}_s_median": median[kind] for kind in KINDS},
                **{f"{kind}_tokens_per_s": batch * t / median[kind] for kind in KINDS},
                **{f"{kind}_s": seconds[f"{kind} {t}"] for kind in KINDS},
            }
        )
    return {
        "config": name,
        "batch_size": batch,
        "attn_block": cfg.attn_block,
        "linear_chunk": cfg.linear_chunk,
        "timed_steps": settings.steps,
        "rows": rows,
    }


def format_linear(report: dict) -> str:
    """One line per length: each kind's tokens/s and median step, and linear's speed over full's."""
    head = (
        f"meshlm bench --compare-linear: config={report['config']} batch={report['batch_size']} one layer, "
        f"forward + backward; attention blocks of {report['attn_block']}, linear chunks of "
        f"{report['linear_chunk']}; timed steps={report['timed_steps']}"
    )
    cols = f"{'seq':>6} {'linear tok/s':>13} {'full tok/s':>11} {'linear s':>9} {'full s':>9}"
    cols += f" {'linear/full':>12}"
    lines = [head, cols, "-" * len(cols)]
    for r in report["rows"]:
        lin, full = r["linear_tokens_per_s"], r["full_tokens_per_s"]
        lines.append(
            f"{r['seq_len']:>6} {lin:>13,.0f} {full:>11,.0f} {r['linear_s_median']:>9.4f} "
            f"{r['full_s_median']:>9.4f} {lin / full:>12.2f}"
        )
    return "\n".join(lines)
