"""``meshlm bench --pp N --compare-schedules``: every pipeline schedule of one model, pp and M, timed side
by side in one run against ``no-pp`` (the same model and batch on the ``dp x mp`` mesh without the
pipeline), each with its measured overhead next to its ideal bubble.

The schedules: GPipe; 1F1B keeping each in-flight micro-batch's residuals (``--remat none``); 1F1B with
``--remat full`` (each layer's forward run again in the backward: the compute of a 1F1B that re-runs the
chunk's forward in its backward slot); interleaved with V = 2 (where M is a multiple of pp and the
layers split into 2 pp chunks). Round-robin timing as the main bench (``time_interleaved``): noise from
the rest of the machine lands on all of them.

Overhead: 1 - t(no-pp) / t(schedule), the median of per-repetition ratios. A second yardstick,
``no-pp x M``: the same step without the pipeline on the same M micro-batches, one after another
(gradient accumulation): its matmuls have a micro-batch's rows, as every tick's do, so the overhead
against it is the pipeline's alone (ticks and bubble), not micro-batching's (``micro_overhead``).
On fake CPU devices every stage's work runs on the host's cores, so a bubble's work costs real time
where it is computed (GPipe's, masked; 1F1B's bubble slots skip their chunk under ``lax.cond``): the
overhead to expect is about the ideal bubble, (pp - 1) / (V M + pp - 1), plus what each tick costs
beyond its chunk's work.
"""

from __future__ import annotations

import dataclasses
import statistics

import jax
import numpy as np

from meshlm.model.config import ModelConfig
from meshlm.parallel.layout import Layout
from meshlm.parallel.pipeline_schedule import schedule_facts
from meshlm.parallel.placement import batch_sharding
from meshlm.perf.bench import NO_PP, Impl, _compiled, _without_pp, compiled_memory, time_interleaved
from meshlm.perf.bench_settings import BenchSettings
from meshlm.sharding.rules import shardings
from meshlm.train.optim import OptimConfig
from meshlm.train.step import init_model, init_opt_state, sharded_step

NO_PP_MICRO = "no-pp x M"  # no pipeline, the M micro-batches one after another (gradient accumulation)
# (row name, schedule, virtual stages, remat)
VARIANTS = (
    ("gpipe", "gpipe", 1, "none"),
    ("1f1b+remat", "1f1b", 1, "full"),
    ("1f1b", "1f1b", 1, "none"),
    ("interleaved", "interleaved", 2, "none"),
)


def variants(cfg: ModelConfig, layout: Layout) -> list[tuple[str, Layout, ModelConfig]]:
    """The schedules this model, pp and M can run: (row name, layout, model)."""
    out = []
    for name, schedule, v, remat in VARIANTS:
        if v > 1 and (layout.microbatches % layout.pp or cfg.n_layers % (layout.pp * v)):
            continue  # interleaved needs M a multiple of pp and 2 pp chunks of layers
        if remat not in cfg.arch.remat:
            continue
        lay = dataclasses.replace(layout, pp_schedule=schedule, virtual_stages=v)
        out.append((name, lay, cfg.replace(remat=remat)))
    return out


def compare_schedules(cfg: ModelConfig, name: str, layout: Layout, settings: BenchSettings) -> dict:
    """Build every schedule's step and no-pp's from one set of parameters and one batch, time them
    round-robin; the JSON-ready report."""
    ocfg = OptimConfig(opt_dtype=settings.opt_dtype)
    params, specs = init_model(cfg, layout, settings.seed)
    host_params = jax.device_get(params)
    rng = np.random.default_rng(settings.seed)
    shape = (settings.batch_size, settings.seq_len)
    host = {k: rng.integers(0, cfg.vocab_size, shape, dtype=np.int32) for k in ("inputs", "targets")}
    impls: list[Impl] = []
    for row, lay, model in variants(cfg, layout):
        own = jax.device_put(host_params, shardings(specs, lay.mesh))  # donated: each its own copy
        step, opt = sharded_step(model, ocfg, lay, specs, own)
        batch = jax.device_put(host, batch_sharding(lay, 1))
        impls.append(_compiled(row, step, own, init_opt_state(opt, own, specs, lay.mesh), batch))
    impls.append(_without_pp(cfg, ocfg, layout, host_params, host))
    m = layout.microbatches
    micro = {k: v.reshape(m, v.shape[0] // m, *v.shape[1:]) for k, v in host.items()}  # [M, B/M, T]
    impls.append(_without_pp(cfg, OptimConfig(accum_steps=m), layout, host_params, micro, name=NO_PP_MICRO))
    seconds, _ = time_interleaved(impls, settings.steps, settings.warmup, lambda dtype: 0.0)
    layouts = [lay for _, lay, _ in variants(cfg, layout)]
    rows = [_row(impl, lay, seconds) for impl, lay in zip(impls[:-2], layouts, strict=True)]
    return {
        "config": name,
        "mesh": layout.shape,
        "pp": layout.pp,
        "microbatches": layout.microbatches,
        "batch_size": settings.batch_size,
        "seq_len": settings.seq_len,
        "timed_steps": settings.steps,
        "no_pp_s_median": statistics.median(seconds[NO_PP]),
        "no_pp_s": seconds[NO_PP],
        "no_pp_micro_s_median": statistics.median(seconds[NO_PP_MICRO]),
        "no_pp_micro_s": seconds[NO_PP_MICRO],
        "schedules": rows,
    }


def _overhead(base: list[float], own: list[float]) -> float:
    """1 - t(base) / t(own), the median of per-repetition ratios."""
    return 1 - statistics.median(b / o for b, o in zip(base, own, strict=True))


def _row(impl: Impl, layout: Layout, seconds: dict[str, list[float]]) -> dict:
    facts = schedule_facts(layout.pipeline)
    memory = compiled_memory(impl.compiled)
    return {
        "name": impl.name,
        "schedule": layout.pp_schedule,
        "virtual_stages": layout.virtual_stages,
        "step_s_median": statistics.median(seconds[impl.name]),
        "step_s": seconds[impl.name],
        "ideal_bubble": facts.bubble_fraction,
        "measured_overhead": _overhead(seconds[NO_PP], seconds[impl.name]),
        "micro_overhead": _overhead(seconds[NO_PP_MICRO], seconds[impl.name]),
        "peak_bytes": memory["peak"] if memory else None,
        "loss": float(impl.metrics["loss"]) if impl.metrics else None,
    }


def format_compare(report: dict) -> str:
    """One line per schedule: step time, measured overhead, ideal bubble, the excess, peak memory."""
    mesh = report["mesh"]
    head = (
        f"meshlm bench --compare-schedules: config={report['config']} pp={report['pp']} mesh="
        f"{mesh['dp']}x{mesh['mp']} M={report['microbatches']} batch={report['batch_size']} "
        f"seq={report['seq_len']} timed steps={report['timed_steps']}; no-pp median "
        f"{report['no_pp_s_median']:.3f} s, no-pp x M (the micro-batches in turn) "
        f"{report['no_pp_micro_s_median']:.3f} s"
    )
    cols = f"{'schedule':<12} {'median s':>9} {'overhead':>9} {'ideal bubble':>13} {'excess':>7}"
    cols += f" {'vs no-pp x M':>13} {'excess':>7} {'peak MiB':>9}"
    lines = [head, cols, "-" * len(cols)]
    for r in report["schedules"]:
        excess = r["measured_overhead"] - r["ideal_bubble"]
        micro = r["micro_overhead"] - r["ideal_bubble"]
        peak = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:.1f}"
        lines.append(
            f"{r['name']:<12} {r['step_s_median']:>9.3f} {r['measured_overhead']:>9.1%} "
            f"{r['ideal_bubble']:>13.1%} {excess * 100:>+6.1f}p {r['micro_overhead']:>13.1%} "
            f"{micro * 100:>+6.1f}p {peak:>9}"
        )
    return "\n".join(lines)
