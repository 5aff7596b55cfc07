"""``meshlm bench --compare-window W``: the blockwise train step with a sliding window of W against the
same model with full causal attention, timed side by side in one run (round-robin, as the main bench:
``time_interleaved``), each with the K/V block pairs its kernel computes per layer and head group.

With full causal attention a query block computes every K/V block up to its own: (n^2 + n) / 2 pairs for
n blocks, O(T^2). With a window W the kernel skips every K/V block wholly before all of its queries'
windows (``model.blockwise._needed``), about n x (W / block + 2) pairs: O(T x W), the work per query
O(W). The step's other work (projections, MLP, the head) is the same in both rows.
"""

from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp
import numpy as np

from meshlm.errors import ConfigError
from meshlm.model import blockwise
from meshlm.model.config import ModelConfig
from meshlm.parallel.axes import CP, PP
from meshlm.parallel.layout import Layout
from meshlm.parallel.placement import batch_sharding
from meshlm.perf.bench import Impl, _compiled, compiled_memory, time_interleaved
from meshlm.perf.bench_settings import BenchSettings
from meshlm.sharding.rules import shardings
from meshlm.train.optim import OptimConfig
from meshlm.train.step import init_model, init_opt_state, sharded_step


def block_pairs(seq_len: int, block: int, window: int) -> int:
    """K/V block pairs the kernel computes for one row of ``seq_len`` positions (``_needed``)."""
    pos = jnp.arange(seq_len, dtype=jnp.int32)[None]
    blocks = blockwise._blocks(pos, min(block, seq_len), fill=jnp.iinfo(jnp.int32).min)[:, 0]  # [n, b]
    valid = blocks != jnp.iinfo(jnp.int32).min
    kpos = jnp.where(valid, blocks, jnp.iinfo(jnp.int32).max)
    kw = {} if not window else {"window": jnp.int32(window)}

    def needed(qp, kp, kv):
        return blockwise._needed(qp[None], kp[None], kv[None], True, **kw)

    pairs = jax.vmap(lambda qp: jax.vmap(lambda kp, kv: needed(qp, kp, kv))(kpos, valid))(blocks)
    return int(np.sum(np.asarray(pairs)))


def compare_window(cfg: ModelConfig, name: str, layout: Layout, settings: BenchSettings) -> dict:
    """Both steps from one set of parameters and one batch, timed round-robin; the JSON-ready report."""
    window = settings.compare_window
    if cfg.attention != "blockwise" or not cfg.arch.attention:
        raise ConfigError("--compare-window times the blockwise kernel: add --attention blockwise")
    if {PP, CP} & set(layout.extra_axes):
        raise ConfigError("--compare-window times the kernel on a dp x mp mesh: drop --cp and --pp")
    if not 0 < window < settings.seq_len:
        raise ConfigError(f"--compare-window {window} must be below --seq-len {settings.seq_len}")
    rows = (("full", cfg.replace(sliding_window=0)), (f"window {window}", cfg.replace(sliding_window=window)))
    params, specs = init_model(rows[0][1], layout, settings.seed)
    host_params = jax.device_get(params)
    rng = np.random.default_rng(settings.seed)
    shape = (settings.batch_size, settings.seq_len)
    host = {k: rng.integers(0, cfg.vocab_size, shape, dtype=np.int32) for k in ("inputs", "targets")}
    impls: list[Impl] = []
    for row, model in rows:
        own = jax.device_put(host_params, shardings(specs, layout.mesh))  # donated: each its own copy
        step, opt = sharded_step(model, OptimConfig(opt_dtype=settings.opt_dtype), layout, specs, own)
        batch = jax.device_put(host, batch_sharding(layout, 1))
        impls.append(_compiled(row, step, own, init_opt_state(opt, own, specs, layout.mesh), batch))
    seconds, _ = time_interleaved(impls, settings.steps, settings.warmup, lambda dtype: 0.0)
    t_local = settings.seq_len // layout.cp
    out = []
    for impl, (_, model) in zip(impls, rows, strict=True):
        memory = compiled_memory(impl.compiled)
        out.append(
            {
                "name": impl.name,
                "window": model.sliding_window,
                "step_s_median": statistics.median(seconds[impl.name]),
                "step_s": seconds[impl.name],
                "block_pairs": block_pairs(t_local, cfg.attn_block, model.sliding_window),
                "peak_bytes": memory["peak"] if memory else None,
            }
        )
    return {
        "config": name,
        "mesh": layout.shape,
        "batch_size": settings.batch_size,
        "seq_len": settings.seq_len,
        "attn_block": cfg.attn_block,
        "timed_steps": settings.steps,
        "rows": out,
    }


def format_window(report: dict) -> str:
    """One line per row: step time, its ratio to full attention, block pairs computed, peak memory."""
    head = (
        f"meshlm bench --compare-window: config={report['config']} batch={report['batch_size']} "
        f"seq={report['seq_len']} blocks of {report['attn_block']} timed steps={report['timed_steps']}"
    )
    cols = f"{'attention':<14} {'median s':>9} {'vs full':>8} {'block pairs':>12} {'peak MiB':>9}"
    lines = [head, cols, "-" * len(cols)]
    full = report["rows"][0]["step_s_median"]
    for r in report["rows"]:
        peak = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:.1f}"
        lines.append(
            f"{r['name']:<14} {r['step_s_median']:>9.3f} {r['step_s_median'] / full:>8.2f} "
            f"{r['block_pairs']:>12,} {peak:>9}"
        )
    return "\n".join(lines)
