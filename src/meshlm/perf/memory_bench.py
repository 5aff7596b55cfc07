"""``meshlm bench --memory-options``: FSDP and sequence parallelism side by side with plain tensor
parallelism and with GSPMD given the same parameter shardings.

Implementations, all from one set of initial parameters and one batch, timed interleaved
(``bench.time_interleaved``: noise from a shared machine lands on all of them alike):

  tp          our ``shard_map`` step, Megatron tensor parallelism (weights over mp, replicated over dp)
  sp          the same with sequence parallelism (``--sp``): same parameter shardings as ``tp``
  fsdp        weights and AdamW moments also split over dp (``--fsdp``)
  fsdp+sp     both
  gspmd       the unsharded model code with ``tp``'s parameter shardings, partitioned by XLA
  gspmd-fsdp  the same with ``fsdp``'s parameter shardings

Each row reports its step time against ``tp`` and against the GSPMD run with the same parameter
shardings (targets: within 1.15x of ``tp``, and no more than 5% slower than that GSPMD run), the
bytes per device of parameters, optimizer state and the compiled step's peak, and its collectives
per step.
"""

from __future__ import annotations

import statistics

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshlm.model.config import ModelConfig
from meshlm.model.transformer import loss_fn
from meshlm.parallel.layout import Layout
from meshlm.parallel.placement import batch_sharding, bytes_per_device
from meshlm.perf.bench import Impl, _compiled, compiled_memory, time_interleaved
from meshlm.perf.bench_settings import BenchSettings
from meshlm.perf.hlo import COLLECTIVES, collectives_per_step
from meshlm.sharding.rules import shardings
from meshlm.sharding.spmd import reference_value_and_grad
from meshlm.train.optim import OptimConfig, adamw, make_step
from meshlm.train.step import init_model, init_opt_state, sharded_step
from meshlm.units import format_bytes

# name -> (fsdp, sp, the GSPMD run with the same parameter shardings)
OPTIONS = {
    "tp": (False, False, "gspmd"),
    "sp": (False, True, "gspmd"),
    "fsdp": (True, False, "gspmd-fsdp"),
    "fsdp+sp": (True, True, "gspmd-fsdp"),
}
TARGET_VS_TP, TARGET_VS_GSPMD = 1.15, 1.05


def build(cfg: ModelConfig, ocfg: OptimConfig, layout: Layout, settings: BenchSettings) -> list[Impl]:
    mesh = layout.mesh
    rng = np.random.default_rng(settings.seed)
    shape = (settings.batch_size, settings.seq_len)
    host = {k: rng.integers(0, cfg.vocab_size, shape, dtype=np.int32) for k in ("inputs", "targets")}
    batch = jax.device_put(host, batch_sharding(layout, 1))
    impls = []
    for fsdp in (False, True):
        params, specs = init_model(cfg, layout.replace(fsdp=fsdp), settings.seed)
        host_params = jax.device_get(params)
        for name, (f, sp, _) in OPTIONS.items():
            if f != fsdp:
                continue
            own = jax.device_put(host_params, shardings(specs, mesh))  # donated: a private copy
            step, opt = sharded_step(cfg, ocfg, layout.replace(fsdp=fsdp, sp=sp), specs, own)
            impls.append(_compiled(name, step, own, init_opt_state(opt, own, specs, mesh), batch))
        name = "gspmd-fsdp" if fsdp else "gspmd"
        impls.append(_gspmd(name, cfg, ocfg, mesh, specs, host_params, batch))
    return impls


def _gspmd(name, cfg, ocfg, mesh, specs, host_params, batch) -> Impl:
    """The unsharded model code on parameters and moments laid out by ``specs``, partitioned by XLA;
    outputs pinned to the same layout (GSPMD would otherwise choose its own for the next step)."""
    params = jax.device_put(host_params, shardings(specs, mesh))
    opt = adamw(ocfg, params)
    opt_state = init_opt_state(opt, params, specs, mesh)
    out = (shardings(specs, mesh), jax.tree.map(lambda x: x.sharding, opt_state), NamedSharding(mesh, P()))
    grad = reference_value_and_grad(lambda par: loss_fn(cfg, par))
    step = jax.jit(make_step(grad, opt, ocfg), donate_argnums=(0, 1), out_shardings=out)
    return _compiled(name, step, params, opt_state, batch)


def _paired(a: list[float], b: list[float]) -> float:
    """Median of per-repetition ratios (steps that ran seconds apart: load drifts cancel)."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def memory_options_bench(cfg: ModelConfig, where, settings: BenchSettings, ocfg=None) -> dict:
    """Rows per implementation (see the module docstring) on ``where`` (a Layout or a jax Mesh: its
    memory options are the rows'); JSON-ready."""
    layout = Layout.of(where)
    settings.check(cfg, layout)
    ocfg = ocfg or OptimConfig(opt_dtype=settings.opt_dtype)
    impls = build(cfg, ocfg, layout, settings.resolved(cfg, layout))
    seconds, _ = time_interleaved(impls, settings.steps, settings.warmup, lambda dtype: 0.0)
    rows = []
    for impl in impls:
        s = seconds[impl.name]
        memory = compiled_memory(impl.compiled)
        per_step = collectives_per_step(impl.compiled.as_text())
        row = {
            "impl": impl.name,
            "step_s_median": statistics.median(s),
            "vs_tp": _paired(s, seconds["tp"]),
            "loss": float(impl.metrics["loss"]),
            "params_bytes": bytes_per_device(impl.params),
            "opt_state_bytes": bytes_per_device(impl.opt_state),
            "peak_bytes": memory["peak"] if memory else None,
            "collectives": {k: per_step[k]["count"] for k in COLLECTIVES},
        }
        if impl.name in OPTIONS:
            row["gspmd_same_shardings"] = OPTIONS[impl.name][2]
            row["vs_gspmd"] = _paired(s, seconds[OPTIONS[impl.name][2]])
        rows.append(row)
    return {"targets": {"vs_tp": TARGET_VS_TP, "vs_gspmd": TARGET_VS_GSPMD}, "rows": rows}


def format_memory_options(report: dict) -> str:
    head = ["impl", "step s", "vs tp", "vs gspmd (same shardings)", "params/dev", "opt/dev", "peak/dev"]
    head += ["all-reduce", "all-gather", "reduce-scatter"]
    mib = lambda b: format_bytes(b, "MiB")
    body = []
    for r in report["rows"]:
        vs = f"{r['vs_gspmd']:.2f}x {r['gspmd_same_shardings']}" if "vs_gspmd" in r else "-"
        c = r["collectives"]
        body.append(
            [r["impl"], f"{r['step_s_median']:.3f}", f"{r['vs_tp']:.2f}x", vs]
            + [mib(r["params_bytes"]), mib(r["opt_state_bytes"]), mib(r["peak_bytes"])]
            + [str(c["all-reduce"]), str(c["all-gather"]), str(c["reduce-scatter"])]
        )
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body, strict=True)]
    fmt = lambda cells: "  ".join(str(x).ljust(w) for x, w in zip(cells, widths, strict=True))
    t = report["targets"]
    note = f"targets: fsdp/sp within {t['vs_tp']}x of tp and at most {t['vs_gspmd']}x GSPMD's step"
    return "\n".join(
        ["memory options (median of paired step-time ratios):", fmt(head), *map(fmt, body), note]
    )
