"""Benchmark of our sharded train step against the same model unsharded and partitioned by GSPMD.

Four implementations of one training step (``optim.make_step``: grads -> clip -> AdamW), all from
the same initial parameters, on the same batch:

  meshlm     ``train_step.sharded_step``: our ``shard_map`` (Megatron) step on the (DP, MP) mesh.
  unsharded  ``train_step.reference_step`` with parameters, optimizer state and batch on device 0.
  gspmd      ``reference_step`` (the unsharded model code) with parameters, optimizer state and
             batch placed with *our* NamedShardings on the Auto mesh: XLA's GSPMD partitions it.
  plain      ``plain.plain_step``: the same model hand-written in plain JAX (no Haiku, no shard_map),
             on device 0: the speed a hand-written model gets, the yardstick for the other three.

With --pp also ``no-pp``; a mixture of experts has no ``plain`` but ``dense-eq``, the dense model of
equal active parameters, and with --ep ``no-ep`` (``bench_moe``). ``--impls`` builds only the ones it
names (``bench_settings.impl_names`` lists them), so that a model filling a device is held once, not
once per implementation; ``--bf16`` computes every one of them in bf16 on float32 master weights (the
cast of ``train --bf16``: ``sharding.spmd.with_compute_dtype``, the hand-written ``plain`` included).

Timing is interleaved: every repetition runs one step of each implementation (rotating the order)
and one float32 and one bfloat16 matmul-peak measurement, so load from other processes on a shared
machine hits all of them alike. We report the median (and min, max) of the timed repetitions; each
step is timed to completion of all its outputs. Each implementation is compiled once, ahead of time,
and the timed executable is the one whose HLO and memory we report.

Model FLOPs and MFU: ``flops``; MFU over the measured matmul peak of the compute dtype, and
``mfu_spec`` over the chip's spec bf16 peak where the chip is known (``chips``). The fewest
all-reduces a step needs, reported next to the ones XLA compiled (``hlo.collectives_per_step``):
``collectives``. The human-readable report, JSON and plot: ``bench_report``.

Memory per device: ``params`` and ``opt_state`` are the bytes of one device's shards
(``placement.bytes_per_device``: every sharding splits evenly, so each device holds as much).
``peak`` is from the compiled step's ``memory_analysis()``: argument + output + temp - alias bytes.
The alias term removes outputs written into donated argument buffers (parameters and
optimizer state), which would otherwise be counted twice; temp is XLA's simulated peak of its
temporaries. So it is the most the executable holds at once, excluding code and runtime overheads.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from meshlm.errors import ConfigError
from meshlm.generate.generator import bench_generation, in_dtype
from meshlm.model.config import ModelConfig
from meshlm.model.transformer import param_shapes
from meshlm.parallel.layout import Layout
from meshlm.parallel.placement import batch_sharding, bytes_per_device, total_bytes
from meshlm.perf.bench_moe import dense_step, moe_comparison, today_step
from meshlm.perf.bench_settings import (
    DENSE,
    DISPATCH_IMPLS,
    IMPLS,
    INT8,
    NO_EP,
    NO_PP,
    TODAY,
    BenchSettings,
    chosen,
    gen_batches,
    impl_names,
)
from meshlm.perf.chips import decode_roofline, device_kind, spec_bf16_peak, spec_int8_peak
from meshlm.perf.collectives import theoretical_collectives
from meshlm.perf.flops import model_flops_per_step
from meshlm.perf.hlo import collectives_of, collectives_per_step
from meshlm.perf.peak import matmul_peak_flops
from meshlm.perf.plain import plain_step
from meshlm.perf.plan_settings import remat_policy
from meshlm.sharding.rules import shardings
from meshlm.sharding.strategy import strategy
from meshlm.train.lora import base_dtype, stored_base
from meshlm.train.optim import OptimConfig, trainable
from meshlm.train.step import COMPUTE_DTYPES, init_model, init_opt_state, reference_step, sharded_step

# --- the implementations ------------------------------------------------------------------------


@dataclass
class Impl:
    """One implementation: its compiled step and its own (donated, so private) state."""

    name: str
    compiled: Any  # jax.stages.Compiled: the executable we time and inspect
    params: Any
    opt_state: Any
    batch: dict
    metrics: dict | None = None

    def step(self) -> None:
        """One training step, waited for to completion of every output (not only the loss)."""
        self.params, self.opt_state, self.metrics = self.compiled(self.params, self.opt_state, self.batch)
        jax.block_until_ready((self.params, self.opt_state, self.metrics))


@dataclass(frozen=True)
class Start:
    """What every implementation starts from: one set of initial parameters (on the host, and as the
    layout's sharded arrays with their specs) and one random batch (on the host), and the compute dtype
    (None: float32; else bf16 compute, float32 master weights, as ``train --bf16``)."""

    cfg: ModelConfig
    ocfg: OptimConfig
    layout: Layout
    settings: BenchSettings
    host_params: Any
    specs: Any
    host: dict
    dtype: Any


def build_impls(cfg: ModelConfig, ocfg: OptimConfig, layout: Layout, settings: BenchSettings) -> list[Impl]:
    """The implementations ``settings`` picks (``--impls``; all by default), from one set of initial
    parameters and one random batch. Only those are built, so only their state is held on the devices."""
    names = chosen(settings, impl_names(cfg, layout))
    params, specs = init_model(cfg, layout, settings.seed)
    params = stored_base(params, base_dtype(settings))  # LoRA: the random base as --base-dtype stores it
    # Copies through the host before anything is donated: each implementation consumes its own
    # buffers. (device_put to one device reuses a replicated leaf's device-0 shard, even with
    # may_alias=False, and donating it would delete our parameter.)
    host_params = jax.device_get(params)
    rng = np.random.default_rng(settings.seed)
    shape = (settings.batch_size, settings.seq_len)
    host = {k: rng.integers(0, cfg.vocab_size, shape, dtype=np.int32) for k in ("inputs", "targets")}
    dtype = COMPUTE_DTYPES[settings.compute_dtype]
    start = Start(cfg, ocfg, layout, settings, host_params, specs, host, dtype)
    impls = []
    if "meshlm" in names:  # the initial arrays themselves, already on the mesh
        impls.append(_meshlm(start, params))
    del params  # not built: freed before the others are (a model that fills the device fits once)
    impls += [BUILDERS[name](start) for name in names if name != "meshlm"]
    return impls


def _meshlm(s: Start, params) -> Impl:
    step, opt = sharded_step(s.cfg, s.ocfg, s.layout, s.specs, params, compute_dtype=s.dtype)
    part = trainable(s.cfg)  # LoRA: AdamW state of the adapters alone
    opt_state = init_opt_state(opt, part.select(params), part.select(s.specs), s.layout.mesh)
    return _compiled("meshlm", step, params, opt_state, _on_mesh(s.layout, s.host))


def _meshlm_int8(s: Start) -> Impl:
    """meshlm's step with the weight matmuls in int8 (``model.quant``), from the same initial parameters."""
    params = jax.device_put(s.host_params, shardings(s.specs, s.layout.mesh))
    cfg = s.cfg.replace(quant="int8")
    step, opt = sharded_step(cfg, s.ocfg, s.layout, s.specs, params, compute_dtype=s.dtype)
    opt_state = init_opt_state(opt, params, s.specs, s.layout.mesh)
    return _compiled(INT8, step, params, opt_state, _on_mesh(s.layout, s.host))


def _unsharded(s: Start) -> Impl:
    device = s.layout.mesh.devices.flat[0]
    params = jax.device_put(s.host_params, device)
    ref, ref_opt = reference_step(s.cfg, s.ocfg, params, compute_dtype=s.dtype)
    return _compiled("unsharded", ref, params, jax.jit(ref_opt.init)(params), jax.device_put(s.host, device))


def _gspmd(s: Start) -> Impl:
    mesh = s.layout.mesh
    params = jax.device_put(s.host_params, shardings(s.specs, mesh))
    ref, ref_opt = reference_step(s.cfg, s.ocfg, params, compute_dtype=s.dtype)
    opt_state = init_opt_state(ref_opt, params, s.specs, mesh)
    return _compiled("gspmd", ref, params, opt_state, _on_mesh(s.layout, s.host))


def _plain(s: Start) -> Impl:
    """The hand-written model (a dense model's only: it has no mixture of experts) on device 0."""
    device = s.layout.mesh.devices.flat[0]
    params = jax.device_put(s.host_params, device)
    hand, hand_opt = plain_step(s.cfg, s.ocfg, params, compute_dtype=s.dtype)
    return _compiled("plain", hand, params, jax.jit(hand_opt.init)(params), jax.device_put(s.host, device))


def _on_mesh(layout: Layout, host: dict):
    return jax.device_put(host, batch_sharding(layout, 1))


BUILDERS: dict[str, Callable[[Start], Impl]] = {
    INT8: _meshlm_int8,
    "unsharded": _unsharded,
    "gspmd": _gspmd,
    "plain": _plain,
    # no-pp, no-ep: the same model and batch on ``layout.flat``
    NO_PP: lambda s: _without_pp(s.cfg, s.ocfg, s.layout, s.host_params, s.host, NO_PP, s.dtype),
    NO_EP: lambda s: _without_pp(s.cfg, s.ocfg, s.layout, s.host_params, s.host, NO_EP, s.dtype),
    DENSE: lambda s: _compiled(DENSE, *dense_step(s.cfg, s.ocfg, s.layout, s.settings, s.host, s.dtype)),
    TODAY: lambda s: _compiled(TODAY, *today_step(s.cfg, s.ocfg, s.layout, s.host_params, s.host, s.dtype)),
    # the same MoE with each sorted dispatch (--impls only: ``bench_settings.DISPATCH_IMPLS``)
    **{
        name: lambda s, name=name, how=how: _compiled(
            name, *today_step(s.cfg, s.ocfg, s.layout, s.host_params, s.host, s.dtype, how)
        )
        for name, how in DISPATCH_IMPLS.items()
    },
}


def _without_pp(
    cfg: ModelConfig, ocfg: OptimConfig, layout: Layout, host_params, host, name=NO_PP, dtype=None
) -> Impl:
    """The step on the dp x mp mesh of the same devices without the pipeline (or ep: ``name``); with
    ``ocfg.accum_steps`` > 1 ``host`` is [A, B/A, T] (gradient accumulation)."""
    from meshlm.sharding.rules import model_specs

    flat = layout.flat
    specs = model_specs(cfg, host_params, flat)
    params = jax.device_put(host_params, shardings(specs, flat.mesh))
    step, opt = sharded_step(cfg, ocfg, flat, specs, params, compute_dtype=dtype)
    batch = jax.device_put(host, batch_sharding(flat, ocfg.accum_steps))
    return _compiled(name, step, params, init_opt_state(opt, params, specs, flat.mesh), batch)


def pipeline_overhead(layout: Layout, seconds: dict[str, list[float]]) -> dict | None:
    """With pp: the schedule's ideal bubble next to the measured overhead, the share of the pipelined
    step's time the same model without pp does not need: 1 - t(no pp) / t(pp), medians of per-repetition
    ratios. On fake CPU devices sharing the host's cores every device's work runs on the same cores, so
    bubbles cost what they compute (GPipe's masked, 1F1B's skipped) (``--compare-schedules`` times every
    schedule side by side: ``perf.bench_pp``)."""
    if layout.pipeline is None or not {NO_PP, "meshlm"} <= set(seconds):
        return None
    from meshlm.parallel.pipeline_schedule import schedule_facts

    facts = schedule_facts(layout.pipeline)
    paired = statistics.median(n / p for n, p in zip(seconds[NO_PP], seconds["meshlm"], strict=True))
    return {
        "schedule": layout.pp_schedule,
        "pp": layout.pp,
        "microbatches": layout.microbatches,
        "virtual_stages": layout.virtual_stages,
        "ideal_bubble": facts.bubble_fraction,
        "measured_overhead": 1 - paired,
    }


def _compiled(name: str, jitted, params, opt_state, batch) -> Impl:
    compiled = jitted.lower(params, opt_state, batch).compile()
    return Impl(name, compiled, params, opt_state, batch)


# --- measuring ------------------------------------------------------------------------------------


def time_interleaved(
    impls: list[Impl], steps: int, warmup: int, peak_fn: Callable[[str], float]
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Seconds per step of each implementation and matmul peaks, measured round-robin.

    Each repetition runs every implementation once, starting one later each time (so none always
    follows the same neighbour), then measures the float32 and bfloat16 peaks: noise from the
    rest of the machine lands on all of them. The first ``warmup`` repetitions are not kept.
    """
    seconds: dict[str, list[float]] = {impl.name: [] for impl in impls}
    peaks: dict[str, list[float]] = {"float32": [], "bfloat16": []}
    for rep in range(warmup + steps):
        k = rep % len(impls)
        for impl in impls[k:] + impls[:k]:
            start = time.perf_counter()
            impl.step()
            if rep >= warmup:
                seconds[impl.name].append(time.perf_counter() - start)
        for dtype, values in peaks.items():
            flops = peak_fn(dtype)
            if rep >= warmup:
                values.append(flops)
    return seconds, peaks


def compiled_memory(compiled) -> dict[str, int] | None:
    """The executable's per-device footprint (see the module docstring), or None if unreported."""
    m = compiled.memory_analysis()
    if m is None:
        return None
    parts = {
        "argument": m.argument_size_in_bytes,
        "output": m.output_size_in_bytes,
        "alias": m.alias_size_in_bytes,
        "temp": m.temp_size_in_bytes,
    }
    peak = {"peak": parts["argument"] + parts["output"] + parts["temp"] - parts["alias"], **parts}
    # XLA:TPU's own peak of its buffer heap: below argument + temp by 0.5-2.7 GiB at the real sizes of
    # scripts/chip_fit.py (its temp counts more than the heap holds), and the heap is what the chip
    # holds; recorded beside the peak, which the verdicts use (docs/memory.md). (XLA:CPU's figure is
    # about its arguments alone: not recorded.)
    leaves = jax.tree.leaves(compiled.input_shardings)
    on_tpu = bool(leaves) and next(iter(leaves[0].device_set)).platform == "tpu"
    return peak | ({"compiler_peak": m.peak_memory_in_bytes} if on_tpu else {})


def impl_result(impl: Impl, seconds: list[float], flops: float, tokens: int, peaks: dict) -> dict:
    """One implementation's row; ``peaks``: the MFU denominators, "measured" (the compute dtype's
    measured matmul peak) and "spec" (the chip's spec bf16 peak, None when the chip is not known)."""
    median = statistics.median(seconds)
    memory = compiled_memory(impl.compiled)
    return {
        "impl": impl.name,
        "step_s_median": median,
        "step_s_min": min(seconds),
        "step_s_max": max(seconds),
        "step_s": seconds,  # every timed repetition, in order (repetition i of each impl ran together)
        "tokens_per_s": tokens / median,
        "mfu": _measured_mfu(flops / median / peaks["measured"]),
        "mfu_spec": None if peaks["spec"] is None else flops / median / peaks["spec"],
        # the int8 step against the chip's spec int8 peak (None: a float step, or a chip not in the table)
        "mfu_spec_int8": None
        if impl.name != INT8 or not peaks.get("int8")
        else flops / median / peaks["int8"],
        "loss": float(impl.metrics["loss"]) if impl.metrics else None,
        "bytes_per_device": {
            "params": bytes_per_device(impl.params),
            "opt_state": bytes_per_device(impl.opt_state),
            "peak": memory["peak"] if memory else None,
            "compiled": memory,
        },
        "collectives": {
            "static": collectives_of(impl.compiled),
            "per_step": collectives_per_step(impl.compiled.as_text()),
        },
    }


def generation_bench(
    cfg: ModelConfig, impls: list[Impl], layout: Layout, settings: BenchSettings
) -> list[dict] | None:
    """Prefill and decode throughput of ``generate.bench_generation`` with meshlm's parameters, one row
    per batch size (``BenchSettings.gen_batches``), each with its memory roofline; None when it is
    skipped (also when --impls leaves meshlm out). Under --bf16 the weights and the KV cache are bf16
    (``generate --bf16``): the roofline's bytes are theirs."""
    ours = [i for i in impls if i.name == "meshlm"]
    if (
        not settings.gen_new_tokens or not strategy(layout).generates or not ours or cfg.lora_rank
    ):  # e.g. no pipelined generation; a LoRA bench times the training step alone
        return None
    params = ours[0].params
    if settings.compute_dtype != "float32":
        params = in_dtype(params, COMPUTE_DTYPES[settings.compute_dtype])
    new = settings.gen_new_tokens  # at most half the context (``BenchSettings.check``)
    prompt = min(settings.seq_len, cfg.max_seq_len - new)
    rows = []
    for batch in gen_batches(settings):
        rates = bench_generation(cfg, params, layout, batch, prompt, new)
        gen = {"batch": batch, "prompt_len": prompt, "new_tokens": new, "dtype": settings.compute_dtype}
        rows.append(gen | rates | decode_roofline(gen | rates, device_kind()))
    return rows


def _measured_mfu(mfu: float) -> float | None:
    """MFU over the measured peak, or None where it is above 1: the step then ran faster than the peak
    matmul, so the peak was not this machine's (a --peak-n too small for the device, or a load spike
    during its timing) and the figure is not a measurement (the report says so: ``mfu_note``)."""
    return mfu if mfu <= 1.0 else None


def mfu_note(results: list[dict], peak_n: int) -> str | None:
    """The report's line where an MFU over the measured peak came out above 1 (``_measured_mfu``)."""
    if all(r["mfu"] is not None for r in results):
        return None
    return (
        f"MFU over the measured peak not shown: a step ran faster than the --peak-n {peak_n} matmul, so "
        "that peak is not this machine's; raise --peak-n (e.g. 8192 on an accelerator) and run again"
    )


def check_peak_fits(n: int) -> None:
    """The peak measurement holds three n x n float32 arrays (a, b and the product) on the device:
    refused before any work where they cannot fit its memory (a CPU's: the host's), never an
    out-of-memory that blames the model."""
    import os

    from meshlm.perf.oom import device_memory
    from meshlm.units import format_bytes

    kind, limit = device_memory()
    if limit is None:  # a CPU reports none: the host's physical memory
        limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    need = 3 * n * n * 4
    if need > limit:
        fits = int((limit / 12) ** 0.5) // 1024 * 1024
        raise ConfigError(
            f"--peak-n {n}: the peak measurement's matmul holds three {n:,} x {n:,} float32 arrays, "
            f"{format_bytes(need)}, more than the {format_bytes(limit)} of the {kind}; use --peak-n "
            f"{max(fits, 1024)} or less (8192 measures an accelerator's peak)"
        )


def step_time_ratios(seconds: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """meshlm's step time over each other implementation's (and unsharded's over plain's), two ways:
    the ratio of the medians, and the median of the per-repetition ratios. The second pairs steps that
    ran seconds apart, so slow drifts in the machine's load cancel; on a shared machine it is the
    steadier of the two."""
    others = (*IMPLS[1:], NO_PP, NO_EP, DENSE, *DISPATCH_IMPLS)
    pairs = [("meshlm", b) for b in others if b in seconds and "meshlm" in seconds]
    # each sorted dispatch's step over dense-eq's too: the side-by-side MoE run's figure of merit
    pairs += [(d, DENSE) for d in DISPATCH_IMPLS if {d, DENSE} <= set(seconds)]
    pairs += [("unsharded", "plain")] if {"unsharded", "plain"} <= set(seconds) else []
    pairs += [(INT8, "meshlm")] if {INT8, "meshlm"} <= set(seconds) else []  # < 1: int8 the faster
    return {f"{a}/{b}": _ratio(seconds[a], seconds[b]) for a, b in pairs}


def _ratio(a: list[float], b: list[float]) -> dict[str, float]:
    return {
        "of_medians": statistics.median(a) / statistics.median(b),
        "paired": statistics.median(x / y for x, y in zip(a, b, strict=True)),
    }


def run_bench(
    cfg: ModelConfig,
    name: str,
    where,
    settings: BenchSettings,
    ocfg: OptimConfig | None = None,
    peak_n: int | None = None,
) -> dict:
    """Build, time and inspect the three implementations on ``where`` (a Layout or a jax Mesh); the
    JSON-ready report (see ``--json``)."""
    layout = Layout.of(where)
    dp, mp = layout.dp, layout.mp
    if peak_n is not None:  # the settings' own, unless given here
        settings = dataclasses.replace(settings, peak_n=peak_n)
    settings.check(cfg, layout)
    settings = settings.resolved(cfg, layout)
    check_peak_fits(settings.peak_n)
    impls = build_impls(cfg, ocfg or OptimConfig(opt_dtype=settings.opt_dtype), layout, settings)
    peak_fn = lambda dtype: matmul_peak_flops(dtype, n=settings.peak_n, repeats=3)
    seconds, peaks = time_interleaved(impls, settings.steps, settings.warmup, peak_fn)
    peak = {dtype: statistics.median(values) for dtype, values in peaks.items()}
    kind = device_kind()
    mfu_peaks = {
        "measured": peak[settings.compute_dtype],
        "spec": spec_bf16_peak(kind),
        "int8": spec_int8_peak(kind),
    }
    tokens = settings.batch_size * settings.seq_len
    shapes = param_shapes(cfg)  # the model's global shapes (no pipeline padding), whichever impls ran
    flops = model_flops_per_step(cfg, shapes, settings.batch_size, settings.seq_len)
    total = total_bytes(shapes)
    return {
        "config": name,
        "mesh": layout.shape,
        "batch_size": settings.batch_size,
        "seq_len": settings.seq_len,
        "timed_steps": settings.steps,
        "compute_dtype": settings.compute_dtype,
        "opt_dtype": settings.opt_dtype,
        "remat": remat_policy(cfg),
        "lora": lora_facts(cfg, settings),
        "impls": [i.name for i in impls],  # the ones built (--impls), in the order of ``results``
        "device_kind": kind,
        "model_flops_per_step": flops,
        "peak_flops": peak,
        # the chip's specs (int8: operations/s); None: not a known chip
        "spec_peak_flops": {"bfloat16": mfu_peaks["spec"], "int8": mfu_peaks["int8"]},
        "param_bytes": {"total": total, "ideal_per_device": total / layout.mp},
        "theoretical_collectives": theoretical_collectives(cfg, dp, mp, layout.cp),
        "results": (results := [impl_result(i, seconds[i.name], flops, tokens, mfu_peaks) for i in impls]),
        "mfu_note": mfu_note(results, settings.peak_n),
        "step_time_ratios": step_time_ratios(seconds),
        **_generation(generation_bench(cfg, impls, layout, settings)),
        "pipeline": pipeline_overhead(layout, seconds),
        "expert_parallel": expert_parallel(cfg, layout, settings, impls, seconds),
        "moe": moe_comparison(cfg, seconds, layout, tokens),
    }


def _generation(rows: list[dict] | None) -> dict:
    """The report's generation: "generation" the first batch's row (None: skipped), "generation_by_batch"
    every --gen-batch row."""
    return {"generation": rows[0] if rows else None, "generation_by_batch": rows}


def lora_facts(cfg: ModelConfig, settings: BenchSettings) -> dict | None:
    """A LoRA bench's adapters and base (None without): rank, alpha, targets and the base's stored
    dtype; its model FLOPs are the frozen base's forward and backward (``perf.flops``)."""
    if not cfg.lora_rank:
        return None
    return {
        "rank": cfg.lora_rank,
        "alpha": cfg.lora_alpha or float(cfg.lora_rank),
        "targets": cfg.lora_targets,
        "base_dtype": base_dtype(settings),
    }


def expert_parallel(cfg: ModelConfig, layout: Layout, settings: BenchSettings, impls, seconds) -> dict | None:
    """With ep: the all-to-alls of our step (count and bytes per step, per device, against the fixed
    size ``ep_all_to_all_bytes`` states) and its time against the same model without ep (paired)."""
    if not layout.experts_split or not {NO_EP, "meshlm"} <= set(seconds):
        return None
    from meshlm.perf.memory_collectives import ep_all_to_all_bytes, ep_all_to_alls

    ours = next(i for i in impls if i.name == "meshlm")
    got = collectives_per_step(ours.compiled.as_text())["all-to-all"]
    shape = dict(batch=settings.batch_size, seq_len=settings.seq_len, itemsize=4)  # float32 activations
    paired = statistics.median(n / e for n, e in zip(seconds[NO_EP], seconds["meshlm"], strict=True))
    return {
        "ep": layout.ep,
        "all_to_all_per_step": got,
        "expected_all_to_all": {
            "count": sum(ep_all_to_alls(cfg, layout).values()),
            "bytes": ep_all_to_all_bytes(cfg, layout, **shape),
        },
        "measured_overhead": 1 - paired,  # 1 - t(no-ep) / t(ep): what the dispatch costs (or saves)
    }
