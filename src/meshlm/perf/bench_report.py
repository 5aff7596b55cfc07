"""The benchmark's report (``bench.run_bench``) for people: a text table, a PNG chart, and both
written with the JSON into an output directory."""

from __future__ import annotations

import json
from pathlib import Path

from meshlm.train.outputs import replace_file
from meshlm.units import in_unit


def _mib(n: float | None) -> str:
    """Bytes as a number of MiB (the column says the unit)."""
    return "-" if n is None else f"{in_unit(n, 'MiB'):.1f}"


def _mfu(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"  # None: above 1, not a measurement (``mfu_note``)


def format_bench(report: dict) -> str:
    """The human-readable report: one row per implementation, then ratios, collectives, generation."""
    return "\n".join([*_header(report), "", *_table(report), "", *_summary(report)])


def _header(report: dict) -> list[str]:
    dp, mp = report["mesh"]["dp"], report["mesh"]["mp"]
    ep = f" + EP{report['mesh']['ep']}" if "ep" in report["mesh"] else ""
    peak, spec = report["peak_flops"], report["spec_peak_flops"]["bfloat16"]
    spec_text = "not a known chip" if spec is None else f"{spec / 1e12:.0f} TFLOP/s bfloat16"
    int8 = report["spec_peak_flops"].get("int8")
    spec_text += "" if int8 is None else f", {int8 / 1e12:.0f} TOP/s int8"
    return [
        f"meshlm bench: config={report['config']} mesh={dp}x{mp}{ep} batch={report['batch_size']} "
        f"seq={report['seq_len']} {report['compute_dtype']} compute, remat {report['remat']}, "
        f"timed steps={report['timed_steps']} (median, interleaved)",
        f"matmul peak: float32 {peak['float32'] / 1e9:.1f} GFLOP/s, bfloat16 {peak['bfloat16'] / 1e9:.1f}"
        f" GFLOP/s; model FLOPs/step {report['model_flops_per_step'] / 1e9:.2f} G",
        f"MFU: over the measured {report['compute_dtype']} matmul peak; MFU spec: over the chip's spec peak "
        f"({report['device_kind']}: {spec_text})",
        *([report["mfu_note"]] if report.get("mfu_note") else []),
        *_lora_line(report.get("lora")),
    ]


def _lora_line(lora: dict | None) -> list[str]:
    if lora is None:
        return []
    return [
        f"LoRA: rank {lora['rank']}, alpha {lora['alpha']:g}, targets {lora['targets']}, frozen base stored "
        f"in {lora['base_dtype']} (random); model FLOPs: 4 x N_base + 6 x N_adapter a token + attention's"
    ]


def _table(report: dict) -> list[str]:
    """One row per implementation: times, throughput, memory and all-reduces per step (per device)."""
    w = max(10, *(len(r["impl"]) for r in report["results"]))  # the impl column: its longest name
    head = (
        f"{'impl':<{w}} {'median s':>9} {'min s':>7} {'max s':>7} {'tokens/s':>9} {'MFU':>6} {'MFU spec':>8} "
        f"{'params MiB':>10} {'opt MiB':>8} {'peak MiB':>9} {'all-reduce/step':>15} {'MiB/step':>9}"
    )
    rows = [head, "-" * len(head)]
    int8 = []
    for r in report["results"]:
        if r.get("mfu_spec_int8") is not None:  # --quant int8 on a known chip: its spec int8 peak too
            int8.append(f"{r['impl']}: MFU over the spec int8 peak {r['mfu_spec_int8']:.3f}")
        mem, ar = r["bytes_per_device"], r["collectives"]["per_step"]["all-reduce"]
        spec = "-" if r["mfu_spec"] is None else f"{r['mfu_spec']:.3f}"
        rows.append(
            f"{r['impl']:<{w}} {r['step_s_median']:>9.3f} {r['step_s_min']:>7.3f} {r['step_s_max']:>7.3f} "
            f"{r['tokens_per_s']:>9.0f} {_mfu(r['mfu']):>6} {spec:>8} {_mib(mem['params']):>10} "
            f"{_mib(mem['opt_state']):>8} {_mib(mem['peak']):>9} {ar['count']:>15} {_mib(ar['bytes']):>9}"
        )
    return rows + int8


def _summary(report: dict) -> list[str]:
    theory, ratios = report["theoretical_collectives"], report["step_time_ratios"]
    rows = [
        "step time ratios (of medians; median of per-repetition ratios): "
        + ", ".join(f"{k} {v['of_medians']:.3f}x; {v['paired']:.3f}x" for k, v in ratios.items()),
        f"theoretical all-reduces/step: {theory['total']} "
        f"({', '.join(f'{k} {v}' for k, v in theory.items() if k != 'total' and v)})",
        f"parameter bytes: total {_mib(report['param_bytes']['total'])} MiB, "
        f"total/mp {_mib(report['param_bytes']['ideal_per_device'])} MiB",
    ]
    if pipe := report.get("pipeline"):
        rows.append(
            f"pipeline ({pipe['schedule']}, pp={pipe['pp']}, M={pipe['microbatches']}): measured overhead "
            f"{pipe['measured_overhead']:.1%} of the step against no-pp (1 - t(no-pp)/t(pp)); ideal bubble "
            f"{pipe['ideal_bubble']:.1%}"
        )
    if ep := report.get("expert_parallel"):
        got, want = ep["all_to_all_per_step"], ep["expected_all_to_all"]
        rows.append(
            f"expert parallelism (ep={ep['ep']}): {got['count']} all-to-alls, {_mib(got['bytes'])} MiB "
            f"per step and device (expected {want['count']}, {_mib(want['bytes'])} MiB: fixed-size buffers); "
            f"overhead {ep['measured_overhead']:.1%} of the step against no-ep (1 - t(no-ep)/t(ep))"
        )
    if moe := report.get("moe"):
        rows.append(_moe_line(moe))
    for gen in report.get("generation_by_batch") or ([report["generation"]] if report["generation"] else []):
        rows.append(
            f"generation (meshlm, batch {gen['batch']}, prompt {gen['prompt_len']}, +{gen['new_tokens']}"
            f"{', bf16 weights and cache' if gen.get('dtype', 'float32') != 'float32' else ''}): "
            f"prefill {gen['prefill_tokens_per_s']:.0f} tokens/s, "
            f"decode {gen['decode_tokens_per_s']:.0f} tokens/s"
            + (
                f" ({gen['decode_step_ms']:.2f} ms a step; memory roofline {gen['roofline_ms']:.2f} ms, "
                f"{gen['over_roofline']:.1f}x)"
                if gen.get("over_roofline")
                else ""
            )
        )
    return rows


def _moe_line(moe: dict) -> str:
    """The mixture of experts against the dense model of equal active parameters (``bench_moe``)."""
    dense = moe["dense_equivalent"]
    times = ", ".join(
        f"{name}/{dense['impl']} {r:.2f}x (overhead {moe['overhead_vs_dense'][name]:.1%})"
        for name, r in moe["step_time_over_dense"].items()
    )
    flops = ", ".join(
        f"{how} {r:.2f}" if r is not None else f"{how} n/a (a kernel)"
        for how, r in moe["expert_flops_over_routed"].items()
    )
    return (
        f"mixture of experts (E={moe['n_experts']}, k={moe['experts_per_token']}): {moe['params']:,} "
        f"parameters, {moe['active_params']:,} active; {dense['impl']} (dense, d_ff {dense['d_ff']}: "
        f'{dense["params"]:,} parameters): {times}; expert FLOPs / routed: {flops} (the "dense" '
        f"dispatch, every expert on every token: E / k = {moe['expert_compute_factor']:g})"
        + (f"; gmm tiles {_gmm_tiles(moe['gmm_tiles'])}" if _runs_gmm(moe) else "")
    )


def _runs_gmm(moe: dict) -> bool:
    """Whether a step of the report ran the gmm kernel (meshlm's dispatch, or gmm-dispatch)."""
    return moe["dispatch"] == "gmm" or "gmm-dispatch" in moe["step_time_over_dense"]


def _gmm_tiles(tiles: dict) -> str:
    """gmm's kernel tiles as (tm, tk, tn) per forward matmul (``bench_moe.gmm_tiles``)."""
    return f"gate/up {tuple(tiles['gate_up'])}, down {tuple(tiles['down'])} ({tiles['tiling']})"


def plot_bench(report: dict, path: str | Path) -> None:
    """A PNG bar chart of tokens/s and MFU per implementation (Agg canvas: no display needed)."""
    from meshlm.train.outputs import isolate_matplotlib

    isolate_matplotlib()  # nothing written under $HOME
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = [r["impl"] for r in report["results"]]
    fig = Figure(figsize=(9, 3.6), layout="constrained")
    FigureCanvasAgg(fig)
    panels = (("tokens_per_s", "tokens / s"), ("mfu", f"MFU (measured {report['compute_dtype']} peak)"))
    for ax, (key, label) in zip(fig.subplots(1, 2), panels, strict=True):
        values = [r[key] or 0.0 for r in report["results"]]  # an MFU not measured (None): no bar
        bars = ax.bar(names, values, color=["tab:blue", "tab:gray", "tab:orange", "tab:green"][: len(names)])
        ax.bar_label(bars, fmt="%.3g")
        ax.margins(y=0.15)  # room for the labels above the tallest bar
        ax.set_ylabel(label)
    mesh = report["mesh"]
    fig.suptitle(
        f"meshlm bench: {report['config']} on {mesh['dp']}x{mesh['mp']}, "
        f"batch {report['batch_size']} x seq {report['seq_len']}"
    )
    replace_file(Path(path), lambda f: fig.savefig(f, format="png", dpi=100))


def write_outputs(report: dict, out_dir: str | Path) -> list[Path]:
    """bench.json and bench.png in ``out_dir`` (created if missing); returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = (json.dumps(report, indent=2) + "\n").encode()
    replace_file(out / "bench.json", lambda f: f.write(text))  # whole or not at all (Ctrl-C: cli/__init__)
    plot_bench(report, out / "bench.png")
    return [out / "bench.json", out / "bench.png"]
