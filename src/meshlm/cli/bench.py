"""meshlm bench: time our sharded train step against the unsharded model and GSPMD, with MFU, memory
per device and collectives; see ``meshlm.perf.bench`` for what is measured and how."""

from __future__ import annotations

import json
from pathlib import Path

from meshlm.cli.common import add_common, add_flags, flag_layout, refuse_options, settings_from, setup
from meshlm.errors import ConfigError
from meshlm.perf.bench_settings import BenchSettings

# Timed with --memory-options instead (against tensor parallelism and GSPMD).
REFUSED = ("fsdp", "sp")


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="step time, MFU, memory and collectives: meshlm vs unsharded vs GSPMD")
    add_common(p, BenchSettings.config)  # also --config and --seed (fields marked CLI_COMMON)
    add_flags(p, BenchSettings, "bench", REFUSED)
    p.set_defaults(fn=run)


def check_out(out: str | None) -> None:
    """bench.json and bench.png go into --out: a file there would fail only after the whole benchmark."""
    if out is not None and Path(out).exists() and not Path(out).is_dir():
        raise ConfigError(
            f"--out {out} is an existing file, but bench writes bench.json and bench.png into a "
            "directory; choose a directory path (new or existing)"
        )


def _format(report: dict, format_bench) -> str:
    if "memory_options" not in report:
        return format_bench(report)
    from meshlm.perf.memory_bench import format_memory_options

    return format_bench(report) + "\n\n" + format_memory_options(report["memory_options"])


def run(args) -> int:
    bs = settings_from(args, BenchSettings)
    check_out(bs.out)
    refuse_options(args, bs, "bench", REFUSED, " (--memory-options times FSDP and SP against tp)")
    if (planned := flag_layout(args, bs)) and bs.batch_size is not None:  # before devices, compiles
        planned.check_batch(bs.batch_size)
    layout = setup(args, bs, planned)
    import jax

    from meshlm.model.config import get_config
    from meshlm.parallel.distributed import is_main, print0
    from meshlm.perf.bench import run_bench
    from meshlm.perf.bench_report import format_bench, write_outputs

    attention = bs.attention_kind(jax.default_backend())  # "auto": flash on a TPU where it applies
    cfg = get_config(bs.config).replace(unroll=bs.unroll, attention=attention, attn_block=bs.attn_block)
    if bs.moe_dispatch is not None:  # a dense model ignores it
        cfg = cfg.replace(moe_dispatch=bs.moe_dispatch)
    if bs.vocab_size is not None:  # the embedding and head follow (padded to vocab_multiple)
        cfg = cfg.replace(vocab_size=bs.vocab_size)
    settings = bs.resolved(cfg, layout)
    name = bs.config if bs.vocab_size is None else f"{bs.config} (vocab {bs.vocab_size})"
    if bs.compare_schedules:
        from meshlm.perf.bench_pp import compare_schedules, format_compare

        bs.check(cfg, layout)
        report = compare_schedules(cfg, name, layout, settings)
        print0(json.dumps(report) if args.json else format_compare(report))
        return 0
    if bs.compare_window:
        from meshlm.perf.bench_window import compare_window, format_window

        bs.check(cfg, layout)
        report = compare_window(cfg, name, layout, settings)
        print0(json.dumps(report) if args.json else format_window(report))
        return 0
    if bs.compare_linear:
        from meshlm.perf.bench_linear import compare_linear, format_linear

        bs.check(cfg, layout)
        report = compare_linear(cfg, name, layout, settings)
        print0(json.dumps(report) if args.json else format_linear(report))
        return 0
    report = run_bench(cfg, name, layout, settings)
    if bs.memory_options:
        from meshlm.perf.memory_bench import memory_options_bench

        report["memory_options"] = memory_options_bench(cfg, layout, settings)
    print0(json.dumps(report) if args.json else _format(report, format_bench))
    if bs.out and is_main():
        write_outputs(report, bs.out)
    return 0
