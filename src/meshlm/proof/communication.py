"""Minimal communication as part of the proof: the compiled sharded train step against the minimum.

Values cannot show wasted communication: a redundant all-reduce leaves every number the same. So
for a meshlm model the proof also compiles the sharded training step (grads, clip by global norm,
AdamW: what ``meshlm train`` runs), counts its collectives per step in the optimized HLO (loop
bodies times their trip counts; ``perf.hlo``) and compares them with the Megatron minimum
(``perf.collectives``). It passes when

* all-reduces: the count is at most the minimum (XLA may combine independent ones over the same
  devices, so fewer is fine) and their bytes at most the minimum's bytes (combining never changes
  bytes; the clip's squared norm may travel as one scalar per parameter leaf, allowed for);
* no all-gather, reduce-scatter, all-to-all or collective-permute appears: Megatron tensor
  parallelism over replicated activations needs none. Under FSDP and sequence parallelism the
  all-gathers and reduce-scatters that replace layer all-reduces are counted against their own
  expected numbers (``perf.memory_collectives``), and the all-reduces SP replaces are not allowed.

A control plants one redundant all-reduce after each row-parallel one and must fail this check.
"""

from __future__ import annotations

import math

import jax

from meshlm.model.moe import capacity
from meshlm.parallel.context import Parallel
from meshlm.parallel.grouped import row_bound
from meshlm.parallel.layout import Layout
from meshlm.perf.collectives import chunked_loss_extra, scalar_slack
from meshlm.perf.hlo import COLLECTIVES, collectives_per_step
from meshlm.perf.memory_collectives import (
    cp_linear_bytes,
    ep_all_to_all_bytes,
    ep_dispatch_bytes,
    expected_all_reduce_bytes,
    expected_collectives,
)
from meshlm.proof.quant_experts_exact import expert_axes
from meshlm.proof.report import check_row
from meshlm.sharding.spmd import sharded_value_and_grad
from meshlm.train.optim import OptimConfig, adamw, make_step


def step_collectives(build_loss, layout: Layout, specs, params, batch, par_cls=Parallel) -> dict:
    """Collectives per step of the compiled sharded train step (clip on, no accumulation: the
    setting the minimum is derived for)."""
    step, opt_state = collectives_step(build_loss, layout, specs, params, par_cls)
    return collectives_per_step(step.lower(params, opt_state, batch).compile().as_text())


def collectives_step(build_loss, layout: Layout, specs, params, par_cls=Parallel, init_state=None):
    """The train step whose collectives ``step_collectives`` counts (jitted, not yet traced), and its
    initial optimizer state (``init_state(opt, params)``: a proof's, made once; default ``opt.init``)."""
    ocfg = OptimConfig(accum_steps=1)
    opt = adamw(ocfg, params)
    grad = sharded_value_and_grad(build_loss, layout, specs, par_cls)
    state = jax.jit(opt.init)(params) if init_state is None else init_state(opt, params)
    return jax.jit(make_step(grad, opt, ocfg)), state


def communication_checks(cfg, layout: Layout, got: dict, *, batch_shape, itemsize, params) -> list[dict]:
    """Rows comparing ``got`` (``step_collectives``) with the minimum for ``cfg`` on the ``layout``
    (with FSDP, read from ``params``' shardings, and SP: ``perf.memory_collectives``)."""
    want = expected_collectives(cfg, layout, params=params)
    count = want["all-reduce"]["total"]
    shape = {"batch": batch_shape[0], "seq_len": batch_shape[1], "itemsize": itemsize}
    nbytes = expected_all_reduce_bytes(cfg, layout, params=params, **shape)
    int8_count, extra_bytes = int8_all_reduces(cfg, layout, **shape)
    count, nbytes = count + int8_count, nbytes + extra_bytes
    slack = scalar_slack(params, itemsize)
    chunk_count, extra_bytes = chunked_loss_extra(cfg, layout, **shape)  # --loss-chunk's, per chunk
    count, nbytes = count + chunk_count, nbytes + extra_bytes
    where = f"{cfg.family} on {layout.label()} (per layer: {cfg.arch.per_layer_text()} with mp > 1)"
    where += f"; --quant int8: +{int8_count} ({INT8_TEXT})" if int8_count else ""
    where += f"; --loss-chunk: +{chunk_count} (the loss's 3 per chunk)" if chunk_count else ""
    ar = got["all-reduce"]
    rows = [
        check_row(
            "all-reduces per step", ar["count"] <= count, f"{ar['count']}, at most {count} for {where}"
        ),
        check_row(
            "all-reduce bytes per step",
            ar["bytes"] <= nbytes + slack,
            f"{ar['bytes']:,}, at most {nbytes:,} (+{slack} for the clip's per-leaf, per-axis scalars)",
        ),
    ]
    for kind in COLLECTIVES[1:]:
        n, causes = got[kind]["count"], want.get(kind, {"total": 0})
        limit = causes["total"]
        why = (
            ", ".join(f"{k} {v}" for k, v in causes.items() if k != "total") or "Megatron tensor parallelism"
        )
        rows.append(check_row(f"{kind}s per step", n <= limit, f"{n}, at most {limit} ({why})"))
    if want["all-to-all"]["total"]:  # expert parallelism: fixed-size buffers, so the bytes are exact
        a2a, a2a_bytes = got["all-to-all"]["bytes"], ep_all_to_all_bytes(cfg, layout, **shape)
        detail = f"{a2a:,}, at most {a2a_bytes:,} (E x N x D per all-to-all, dispatch and return)"
        rows.append(check_row("all-to-all bytes per step", a2a <= a2a_bytes, detail))
    for kind, nbytes in ep_dispatch_bytes(cfg, layout, **shape).items():
        if set(want[kind]) == {"ep_dispatch_forward", "ep_dispatch_backward", "total"}:  # ep's alone
            got_bytes = got[kind]["bytes"]
            detail = f"{got_bytes:,}, at most {nbytes:,} (the sorted ep dispatch: ep x N tokens gathered)"
            rows.append(check_row(f"{kind} bytes per step", got_bytes <= nbytes, detail))
    linear = cp_linear_bytes(cfg, layout, **shape)
    if linear and set(want["all-gather"]) == {"cp_linear_forward", "total"}:  # the linear layers' alone
        got_bytes = got["all-gather"]["bytes"]
        detail = f"{got_bytes:,}, at most {linear:,} (cp: the linear layers' conv tails and state maps)"
        rows.append(check_row("all-gather bytes per step", got_bytes <= linear, detail))
    return rows


INT8_TEXT = (
    "per matmul whose contraction mp splits, 2 scale maxes and 1 int32 sum; per weight gradient with dp > 1, "
    "2 token maxes (an expert's: with data shards outside ep or cp)"
)


def int8_all_reduces(cfg, layout: Layout, *, batch: int, seq_len: int, itemsize: int) -> tuple[int, int]:
    """The all-reduces ``--quant int8`` adds to a step (``model.quant``): (count, bytes). Per layer, each
    row-parallel matmul's forward and each column-parallel matmul's dx contract over mp's split: the
    two scales' exact maxes ([N] and [M] or [K] per shard) and the int32 sum [N, D] (the float all-reduce
    that follows stays: it adds zeros). With more than one batch shard, each weight gradient's two
    per-channel token maxes. Recomputation (remat) repeats the forward's. A mixture of experts' layers:
    the shared experts' dense matmuls and the experts' (``_expert_extras``)."""
    if getattr(cfg, "quant", "none") == "none":
        return 0, 0
    d, f = cfg.d_model, cfg.d_ff
    attn = cfg.arch.attention
    h, kv, e = (cfg.n_heads, cfg.kv_heads, cfg.dim_per_head) if attn else (0, 0, 0)
    gated = cfg.arch.mlp != "gelu"
    cols = [h * e, kv * e, kv * e] if attn else []  # output widths (global)
    rows = [h * e] if attn else []  # contraction widths (global)
    n = batch // layout.dp * seq_len // max(layout.cp, 1)  # tokens per device in a layer
    moe = len(cfg.moe_layers) if cfg.arch.moe else 0
    shared = cfg.n_shared_experts * cfg.moe_d_ff + cfg.shared_expert_d_ff if moe else 0
    kinds = (  # (layers, the MLP's output widths, its contraction widths)
        (cfg.n_layers - moe, [f] * (2 if gated else 1), [f]),
        (moe, [shared] * 2 if shared else [], [shared] if shared else []),
    )
    count = nbytes = 0
    for layers, mlp_cols, mlp_rows in kinds:
        c, b = _dense_extras(layout, cols + mlp_cols, rows + mlp_rows, n, d, itemsize, cfg.remat != "none")
        count, nbytes = count + layers * c, nbytes + layers * b
    if moe:
        c, b = _expert_extras(cfg, layout, n, itemsize)
        count, nbytes = count + moe * c, nbytes + moe * b
    return count, nbytes


def _dense_extras(layout: Layout, cols, rows, n: int, d: int, itemsize: int, remat: bool) -> tuple[int, int]:
    """(count, bytes) of one layer's dense int8 matmuls (``int8_all_reduces``)."""
    count = nbytes = 0
    if layout.mp > 1:
        fwd = 2 if remat else 1
        count += 3 * len(rows) * fwd + 3 * len(cols)
        nbytes += fwd * sum(4 * n * d + itemsize * (n + d) for _ in rows)  # int32 [N, D], scales [N], [D]
        nbytes += sum(4 * n * d + itemsize * (n + d) for _ in cols)  # dx: int32 [N, D], scales [N], [D]
    if layout.dp * max(layout.cp, 1) > 1:
        count += 2 * (len(rows) + len(cols))
        nbytes += sum(itemsize * (w // layout.mp + d) for w in rows + cols)  # [K] and [M] per matmul
    return count, nbytes


def _expert_extras(cfg, layout: Layout, n: int, itemsize: int) -> tuple[int, int]:
    """(count, bytes) of one MoE layer's int8 experts (``model.quant_experts``: gate and up one matmul,
    down one) over R rows: with mp > 1 down's forward and gate/up's dx each 2 maxes ([R], [E_here, D])
    and 1 int32 sum [R, D]; with an expert's rows on several data shards, 2 per-expert channel maxes
    per matmul ([E_here, D + 2I/mp] and [E_here, I/mp + D])."""
    d, i, mp = cfg.d_model, cfg.moe_d_ff // layout.mp, layout.mp
    here = cfg.n_experts // layout.ep if layout.experts_split else cfg.n_experts
    r = _expert_rows(cfg, layout, n, here)
    count = nbytes = 0
    if mp > 1:
        fwd = 2 if cfg.remat != "none" else 1
        count += 3 * (fwd + 1)
        nbytes += (fwd + 1) * (4 * r * d + itemsize * (r + here * d))
    if math.prod(layout.mesh_shape[a] for a in expert_axes(layout)) > 1:
        count += 4
        nbytes += itemsize * here * (2 * d + 3 * i)
    return count, nbytes


def _expert_rows(cfg, layout: Layout, n: int, here: int) -> int:
    """R, the rows of a device's expert matmuls: ``parallel.grouped.row_bound`` of the tokens the
    dispatch sees (the ep group's with ep on), every token per expert for "dense", the capacity's slots."""
    tokens = n * layout.ep if layout.experts_split else n
    if cfg.moe_dispatch == "dense":
        return here * tokens
    cap = min(tokens, capacity(cfg, n * layout.dp * max(layout.cp, 1))) if cfg.moe_capacity_factor else 0
    return row_bound(tokens, cfg.experts_per_token, here, cfg.moe_dispatch, cap)
