"""Benchmark of our sharded train step against the same model unsharded and partitioned by GSPMD.

Three implementations of one training step (``optim.make_step``: grads -> clip -> AdamW), all from
the same initial parameters, on the same batch:

  meshlm     ``train_step.sharded_step``: our ``shard_map`` (Megatron) step on the (DP, MP) mesh.
  unsharded  ``train_step.reference_step`` with parameters, optimizer state and batch on device 0.
  gspmd      ``reference_step`` (the unsharded model code) with parameters, optimizer state and
             batch placed with *our* NamedShardings on the Auto mesh: XLA's GSPMD partitions it.

Timing is interleaved: every repetition runs one step of each implementation (rotating the order)
and one float32 and one bfloat16 matmul-peak measurement, so load from other processes on a shared
machine hits all of them alike. We report the median (and min, max) of the timed repetitions; each
step is timed to completion of all its outputs. Each implementation is compiled once, ahead of time,
and the timed executable is the one whose HLO and memory we report.

Model FLOPs per step (PaLM, Chowdhery et al. 2022, appendix B; as in Chinchilla)::

    6 * N * tokens  +  12 * n_layers * T * d_model * tokens

N counts the weights of every matmul: attention Q/K/V/O, the MLP and the output projection (or the
embedding table when it is tied to the output); not the embedding lookup, norms or biases. The
second term is attention's two T x T matmuls (QK^T and AV: 2 * 2 * T * d_model FLOPs per token per
layer forward, x3 with the backward), counting the full score matrix although causal masking makes
half of it unnecessary. Rematerialisation's recomputation is not counted: it is not model work.
MFU = model FLOPs per step / median step time / measured float32 matmul peak (``peak.py``).

Memory per device (device 0): ``params`` and ``opt_state`` are the bytes of the shards that live on
device 0. ``peak`` is from the compiled step's ``memory_analysis()``: argument + output + temp - alias
bytes. The alias term removes outputs written into donated argument buffers (parameters and
optimizer state), which would otherwise be counted twice; temp is XLA's simulated peak of its
temporaries. So it is the most the executable holds at once, excluding code and runtime overheads.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

from meshlm.errors import ConfigError
from meshlm.model.attention import kv_replicated
from meshlm.model.config import ModelConfig
from meshlm.model.params import flat_params, is_embedding, is_matmul_weight, leaf_name
from meshlm.parallel.axes import DP, MP
from meshlm.parallel.rules import batch_sharding, shardings
from meshlm.perf.hlo import COLLECTIVES, collectives_from_text, collectives_of
from meshlm.perf.peak import matmul_peak_flops
from meshlm.train.optim import OptimConfig
from meshlm.train.step import init_model, init_opt_state, reference_step, sharded_step

IMPLS = ("meshlm", "unsharded", "gspmd")
MIN_STEPS = 5  # fewer timed steps give a median that is mostly noise on a shared machine
# Defaults that keep a `small` bench near 1.5 minutes on 2 CPU cores (a step takes 1.7 s on an idle
# machine, 4 s on a loaded one; batch 8 x 256 doubles that).
DEFAULT_BATCH = 4
DEFAULT_SEQ = 256


@dataclass(frozen=True)
class BenchSettings:
    batch_size: int = DEFAULT_BATCH  # global batch rows (split over DP)
    seq_len: int = DEFAULT_SEQ  # tokens per row (capped at the config's max_seq_len by the CLI)
    steps: int = MIN_STEPS  # timed repetitions of each implementation
    warmup: int = 1  # untimed repetitions first (first-touch allocation, caches)
    seed: int = 0
    gen_new_tokens: int = 16  # generation benchmark: tokens decoded per row (0 skips it)

    def check(self, cfg: ModelConfig, dp: int) -> None:
        if self.steps < MIN_STEPS:
            raise ConfigError(
                f"--steps must be >= {MIN_STEPS} (a median of fewer is noise), got {self.steps}"
            )
        if self.warmup < 0:
            raise ConfigError(f"warmup must be >= 0, got {self.warmup}")
        if self.batch_size < 1 or self.batch_size % dp:
            raise ConfigError(f"--batch-size {self.batch_size} must be a positive multiple of dp={dp}")
        if not 1 <= self.seq_len <= cfg.max_seq_len:
            raise ConfigError(f"--seq-len {self.seq_len} must be in [1, max_seq_len={cfg.max_seq_len}]")


# --- model FLOPs ----------------------------------------------------------------------------------


def matmul_param_count(cfg: ModelConfig, params) -> int:
    """N of the FLOPs formula: weights used in matmuls (see the module docstring); global sizes."""
    total = 0
    for path, p in flat_params(params).items():
        if is_embedding(path):  # the lookup is no matmul; the table is one when tied to the output
            total += p.size if cfg.tie_embeddings and leaf_name(path) == "embeddings" else 0
        elif is_matmul_weight(path):
            total += p.size
    return int(total)


def model_flops_per_step(cfg: ModelConfig, params, batch_size: int, seq_len: int) -> float:
    tokens = batch_size * seq_len
    attention = 12 * cfg.n_layers * seq_len * cfg.d_model if cfg.family != "ff" else 0
    return float((6 * matmul_param_count(cfg, params) + attention) * tokens)


# --- theoretical communication --------------------------------------------------------------------


def theoretical_collectives(cfg: ModelConfig, dp: int, mp: int) -> dict[str, int]:
    """The fewest all-reduces one training step needs under Megatron tensor parallelism, by cause.

    Per step (a layer loop that runs L times counts L times). With mp > 1 activations between blocks
    are replicated over MP and the weights split, so per layer:

    * forward, one all-reduce per exit from a row-parallel matmul (``par.g`` / ``row_out``): gptj's
      parallel block sums the attention and MLP partials in one (1); llama's sequential attention
      then MLP needs two (2); the ff prototype's MLP one (1). With ``remat`` the backward pass
      recomputes the forward, its all-reduces included, so these count twice.
    * backward, one per entry into a column-parallel region (``par.f``, whose transpose sums the
      input gradient over MP): again 1 / 2 / 1.
    * KV projections replicated because mp > n_kv_heads: their gradients summed over MP (1; XLA may
      combine it with the layer's backward all-reduce, which is independent of it).

    Outside the layers, with mp > 1:

    * embedding: the vocabulary-parallel lookup sums partial rows forward (1); its backward is
      local (each shard scatters into its own rows): none.
    * output projection: its input enters a column-parallel region: 1 backward.
    * vocabulary-parallel cross-entropy: max, target logit and sum of exp over the shards, three
      small [B, T] all-reduces forward (3; the last two are independent and may be combined). Their
      backward is local (the max is under stop_gradient; a psum transposes to the identity).
    * gradient clipping: the squared norm of the MP-sharded gradients summed over MP (1 scalar;
      we assume clipping is on, ``OptimConfig``'s default).

    With dp > 1: the gradient all-reduce over DP (1 if every gradient goes in one tuple; the bytes
    are those of one device's parameters whatever the count) and the loss mean over DP (1 scalar,
    for reporting the loss). Replicated parameters (norms, biases added after an all-reduce) need
    no MP all-reduce: they act on replicated activations. Returns counts by cause and ``total``.
    """
    per_layer = 2 if cfg.family == "llama" else 1
    sharded = mp > 1
    kv_rep = cfg.family != "ff" and sharded and kv_replicated(cfg.kv_heads, mp)
    out = {
        "layer_forward": cfg.n_layers * per_layer * (2 if cfg.remat else 1) * sharded,
        "layer_backward": cfg.n_layers * per_layer * sharded,
        "kv_replicated_grads": cfg.n_layers * kv_rep,
        "embedding": int(sharded),
        "head_backward": int(sharded),
        "loss": 3 * sharded,
        "grad_norm": int(sharded),
        "dp_gradients": int(dp > 1),
        "dp_loss": int(dp > 1),
    }
    out["total"] = sum(out.values())
    return out


# --- collectives actually compiled, per step ------------------------------------------------------

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_BODY = re.compile(r"\bbody=%?([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLS = re.compile(r"\b(?:calls|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([^}]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[\d+,(\d+)\]")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")


def group_size(line: str) -> int | None:
    """Participants per replica group of a collective instruction line; None if not printed."""
    if m := _GROUPS_LIST.search(line):
        return len([x for x in m.group(1).split(",") if x.strip()])
    if m := _GROUPS_IOTA.search(line):
        return int(m.group(1))
    if m := _GROUPS_MESH.search(line):
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
        return math.prod(int(sizes.get(a, 1)) for a in re.findall(r"'(\w+)'", m.group(2)))
    return None


def _computations(hlo_text: str) -> tuple[dict[str, list[str]], str]:
    """{computation name: its instruction lines} and the entry computation's name."""
    comps: dict[str, list[str]] = {}
    entry, current = "", None
    for line in hlo_text.splitlines():
        if current is None and (m := _HEADER.match(line)):
            current = m.group(2)
            comps[current] = []
            entry = current if m.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif current is not None:
            comps[current].append(line)
    return comps, entry


def _callees(line: str) -> list[tuple[str, int]]:
    """(computation, times it runs) called by one instruction; while bodies run their trip count."""
    if " while(" in line and (body := _BODY.search(line)):
        trip = _TRIP.search(line)
        return [(body.group(1), int(trip.group(1)) if trip else 1)]
    out = [(name, 1) for name in _CALLS.findall(line)]
    if m := _BRANCHES.search(line):
        out += [(b.strip().lstrip("%"), 1) for b in m.group(1).split(",") if b.strip()]
    return out


def collectives_per_step(hlo_text: str) -> dict[str, Any]:
    """Collectives one execution runs: loop bodies times their known trip count (``hlo`` counts each
    op once), leaving out trivial ones whose replica groups have one device (no-ops) but counting
    them under ``trivial``. Per kind {"count", "bytes"} (result bytes, as ``hlo`` counts them)."""
    comps, entry = _computations(hlo_text)
    memo: dict[str, tuple[dict, int]] = {}

    def total(name: str) -> tuple[dict, int]:
        if name not in memo:
            lines = comps.get(name, [])
            real = [ln for ln in lines if group_size(ln) != 1]
            counts, trivial = collectives_from_text("\n".join(real)), len(lines) - len(real)
            for line in lines:
                for callee, times in _callees(line):
                    sub, sub_trivial = total(callee)
                    trivial += times * sub_trivial
                    for kind in COLLECTIVES:
                        for key in ("count", "bytes"):
                            counts[kind][key] += times * sub[kind][key]
            memo[name] = (counts, trivial)
        return memo[name]

    counts, trivial = total(entry)
    return {**counts, "trivial": trivial}


# --- the three implementations --------------------------------------------------------------------


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


def build_impls(cfg: ModelConfig, ocfg: OptimConfig, mesh, settings: BenchSettings) -> list[Impl]:
    """The three implementations, from one set of initial parameters and one random batch."""
    params, specs = init_model(cfg, mesh, settings.seed)
    param_sh = shardings(specs, mesh)
    # Copies through the host before anything is donated: each implementation consumes its own
    # buffers. (device_put to one device reuses a replicated leaf's device-0 shard, even with
    # may_alias=False, and donating it would delete our parameter.)
    host_params = jax.device_get(params)
    gspmd_params = jax.device_put(host_params, param_sh)
    device = mesh.devices.flat[0]
    one_params = jax.device_put(host_params, device)
    rng = np.random.default_rng(settings.seed)
    shape = (settings.batch_size, settings.seq_len)
    host = {k: rng.integers(0, cfg.vocab_size, shape, dtype=np.int32) for k in ("inputs", "targets")}
    mesh_batch = jax.device_put(host, batch_sharding(mesh, 1))

    step, opt = sharded_step(cfg, ocfg, mesh, specs, params)
    ours = _compiled("meshlm", step, params, init_opt_state(opt, params, specs, mesh), mesh_batch)
    ref, ref_opt = reference_step(cfg, ocfg, one_params)
    one_opt = jax.jit(ref_opt.init)(one_params)
    unsharded = _compiled("unsharded", ref, one_params, one_opt, jax.device_put(host, device))
    gref, gref_opt = reference_step(cfg, ocfg, gspmd_params)
    gopt = init_opt_state(gref_opt, gspmd_params, specs, mesh)
    return [ours, unsharded, _compiled("gspmd", gref, gspmd_params, gopt, mesh_batch)]


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


def bytes_on(tree, device) -> int:
    """Bytes of ``tree``'s shards that live on ``device``."""
    return sum(
        shard.data.nbytes
        for leaf in jax.tree.leaves(tree)
        for shard in leaf.addressable_shards
        if shard.device == device
    )


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
    return {"peak": parts["argument"] + parts["output"] + parts["temp"] - parts["alias"], **parts}


def impl_result(impl: Impl, seconds: list[float], flops: float, tokens: int, peak32: float, device) -> dict:
    median = statistics.median(seconds)
    memory = compiled_memory(impl.compiled)
    return {
        "impl": impl.name,
        "step_s_median": median,
        "step_s_min": min(seconds),
        "step_s_max": max(seconds),
        "step_s": seconds,  # every timed repetition, in order (repetition i of each impl ran together)
        "tokens_per_s": tokens / median,
        "mfu": flops / median / peak32,
        "loss": float(impl.metrics["loss"]) if impl.metrics else None,
        "bytes_per_device": {
            "params": bytes_on(impl.params, device),
            "opt_state": bytes_on(impl.opt_state, device),
            "peak": memory["peak"] if memory else None,
            "compiled": memory,
        },
        "collectives": {
            "static": collectives_of(impl.compiled),
            "per_step": collectives_per_step(impl.compiled.as_text()),
        },
    }


def generation_bench(cfg: ModelConfig, params, mesh, settings: BenchSettings) -> dict | None:
    """Prefill and decode throughput of ``generate.bench_generation``; None when it is unavailable."""
    if not settings.gen_new_tokens:
        return None
    try:
        from meshlm.generate.generator import bench_generation
    except ImportError:
        return None
    new = min(settings.gen_new_tokens, cfg.max_seq_len // 2)
    prompt = min(settings.seq_len, cfg.max_seq_len - new)
    rates = bench_generation(cfg, params, mesh, settings.batch_size, prompt, new)
    return {"batch": settings.batch_size, "prompt_len": prompt, "new_tokens": new, **rates}


def step_time_ratios(seconds: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """meshlm's step time over each other implementation's, two ways: the ratio of the medians, and
    the median of the per-repetition ratios. The second pairs steps that ran seconds apart, so slow
    drifts in the machine's load cancel; on a shared machine it is the steadier of the two."""
    out = {}
    for other in IMPLS[1:]:
        pairs = zip(seconds["meshlm"], seconds[other], strict=True)
        out[f"meshlm/{other}"] = {
            "of_medians": statistics.median(seconds["meshlm"]) / statistics.median(seconds[other]),
            "paired": statistics.median(a / b for a, b in pairs),
        }
    return out


def run_bench(
    cfg: ModelConfig,
    name: str,
    mesh,
    settings: BenchSettings,
    ocfg: OptimConfig | None = None,
    peak_n: int = 2048,
) -> dict:
    """Build, time and inspect the three implementations; the JSON-ready report (see ``--json``)."""
    dp, mp = mesh.shape[DP], mesh.shape[MP]
    settings.check(cfg, dp)
    impls = build_impls(cfg, ocfg or OptimConfig(), mesh, settings)
    peak_fn = lambda dtype: matmul_peak_flops(dtype, n=peak_n, repeats=3)
    seconds, peaks = time_interleaved(impls, settings.steps, settings.warmup, peak_fn)
    peak = {dtype: statistics.median(values) for dtype, values in peaks.items()}
    tokens = settings.batch_size * settings.seq_len
    flops = model_flops_per_step(cfg, impls[0].params, settings.batch_size, settings.seq_len)
    device = mesh.devices.flat[0]
    total = sum(leaf.nbytes for leaf in jax.tree.leaves(impls[0].params))
    return {
        "config": name,
        "mesh": {"dp": dp, "mp": mp},
        "batch_size": settings.batch_size,
        "seq_len": settings.seq_len,
        "timed_steps": settings.steps,
        "model_flops_per_step": flops,
        "peak_flops": peak,
        "param_bytes": {"total": total, "ideal_per_device": total / mp},
        "theoretical_collectives": theoretical_collectives(cfg, dp, mp),
        "results": [impl_result(i, seconds[i.name], flops, tokens, peak["float32"], device) for i in impls],
        "step_time_ratios": step_time_ratios(seconds),
        "generation": generation_bench(cfg, impls[0].params, mesh, settings),
    }


# --- reporting ------------------------------------------------------------------------------------


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def format_bench(report: dict) -> str:
    """The human-readable report: one row per implementation, then ratios, collectives, generation."""
    dp, mp = report["mesh"]["dp"], report["mesh"]["mp"]
    peak = report["peak_flops"]
    rows = [
        f"meshlm bench: config={report['config']} mesh={dp}x{mp} batch={report['batch_size']} "
        f"seq={report['seq_len']} timed steps={report['timed_steps']} (median, interleaved)",
        f"matmul peak: float32 {peak['float32'] / 1e9:.1f} GFLOP/s, bfloat16 {peak['bfloat16'] / 1e9:.1f}"
        f" GFLOP/s; model FLOPs/step {report['model_flops_per_step'] / 1e9:.2f} G",
        "",
    ]
    head = (
        f"{'impl':<10} {'median s':>9} {'min s':>7} {'max s':>7} {'tokens/s':>9} {'MFU':>6} "
        f"{'params MiB':>10} {'opt MiB':>8} {'peak MiB':>9} {'all-reduce/step':>15} {'MiB/step':>9}"
    )
    rows += [head, "-" * len(head)]
    for r in report["results"]:
        mem, ar = r["bytes_per_device"], r["collectives"]["per_step"]["all-reduce"]
        rows.append(
            f"{r['impl']:<10} {r['step_s_median']:>9.3f} {r['step_s_min']:>7.3f} {r['step_s_max']:>7.3f} "
            f"{r['tokens_per_s']:>9.0f} {r['mfu']:>6.3f} {_mib(mem['params']):>10} "
            f"{_mib(mem['opt_state']):>8} {_mib(mem['peak']):>9} {ar['count']:>15} {_mib(ar['bytes']):>9}"
        )
    theory, ratios = report["theoretical_collectives"], report["step_time_ratios"]
    rows += [
        "",
        "step time ratios (of medians; median of per-repetition ratios): "
        + ", ".join(f"{k} {v['of_medians']:.3f}x; {v['paired']:.3f}x" for k, v in ratios.items()),
        f"theoretical all-reduces/step: {theory['total']} "
        f"({', '.join(f'{k} {v}' for k, v in theory.items() if k != 'total' and v)})",
        f"parameter bytes: total {_mib(report['param_bytes']['total'])} MiB, "
        f"total/mp {_mib(report['param_bytes']['ideal_per_device'])} MiB",
    ]
    gen = report["generation"]
    if gen is not None:
        rows.append(
            f"generation (meshlm, batch {gen['batch']}, prompt {gen['prompt_len']}, +{gen['new_tokens']}): "
            f"prefill {gen['prefill_tokens_per_s']:.0f} tokens/s, "
            f"decode {gen['decode_tokens_per_s']:.0f} tokens/s"
        )
    return "\n".join(rows)


def plot_bench(report: dict, path: str | Path) -> None:
    """A PNG bar chart of tokens/s and MFU per implementation (Agg canvas: no display needed)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = [r["impl"] for r in report["results"]]
    fig = Figure(figsize=(9, 3.6), layout="constrained")
    FigureCanvasAgg(fig)
    panels = (("tokens_per_s", "tokens / s"), ("mfu", "MFU (fp32 peak)"))
    for ax, (key, label) in zip(fig.subplots(1, 2), panels, strict=True):
        values = [r[key] for r in report["results"]]
        bars = ax.bar(names, values, color=["tab:blue", "tab:gray", "tab:orange"][: len(names)])
        ax.bar_label(bars, fmt="%.3g")
        ax.margins(y=0.15)  # room for the labels above the tallest bar
        ax.set_ylabel(label)
    mesh = report["mesh"]
    fig.suptitle(
        f"meshlm bench: {report['config']} on {mesh['dp']}x{mesh['mp']}, "
        f"batch {report['batch_size']} x seq {report['seq_len']}"
    )
    fig.savefig(path, dpi=100)


def write_outputs(report: dict, out_dir: str | Path) -> list[Path]:
    """bench.json and bench.png in ``out_dir`` (created if missing); returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    plot_bench(report, out / "bench.png")
    return [out / "bench.json", out / "bench.png"]
