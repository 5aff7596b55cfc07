"""meshlm bench: time our sharded train step against the unsharded model and GSPMD, with MFU, memory
per device and collectives; see ``meshlm.perf.bench`` for what is measured and how."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from meshlm.cli.common import add_common, add_flags, flag_layout, refuse_options, settings_from, setup
from meshlm.errors import ConfigError
from meshlm.model.config import default_seq_len, get_config
from meshlm.perf.bench_settings import BenchSettings, check_impls
from meshlm.train.lora import with_lora

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


def _format(report: dict) -> str:
    """The implementations' report as text (with --memory-options, those options' table after it)."""
    from meshlm.perf.bench_report import format_bench

    if "memory_options" not in report:
        return format_bench(report)
    from meshlm.perf.memory_bench import format_memory_options

    return format_bench(report) + "\n\n" + format_memory_options(report["memory_options"])


def run(args) -> int:
    bs = settings_from(args, BenchSettings)
    check_out(bs.out)
    refuse_options(args, bs, "bench", REFUSED, " (--memory-options times FSDP and SP against tp)")
    if planned := flag_layout(args, bs):  # before devices, compiles
        if bs.batch_size is not None:
            planned.check_batch(bs.batch_size)
        # before the backend is known: "auto" is never "dense", the one dispatch that changes the names
        early = "blocks" if bs.moe_dispatch == "auto" else bs.moe_dispatch
        check_impls(bs, with_lora(bs, get_config(bs.config)).replace(moe_dispatch=early), planned)
    layout = setup(args, bs, planned, model=lambda: get_config(bs.config))
    import jax

    from meshlm.parallel.distributed import is_main, print0
    from meshlm.train.step import step_model

    backend = jax.default_backend()  # "auto": flash on a TPU where it applies; ragged_dot on TPU and GPU
    seq_len = default_seq_len(get_config(bs.config), bs.seq_len or 0)  # what auto decides on
    attention, dispatch = bs.attention_kind(backend, seq_len), bs.dispatch_fields(backend)  # dense ignores it
    cfg = get_config(bs.config).replace(
        attention=attention, attn_block=bs.attn_block, loss_chunk=bs.loss_chunk, **dispatch
    )
    # --remat and --unroll as train applies them (a rolled loop under remat, where its saving needs one)
    cfg = step_model(cfg, remat=bs.remat, unroll=bs.unroll, fsdp=False)
    if bs.vocab_size is not None:  # the embedding and head follow (padded to vocab_multiple)
        cfg = cfg.replace(vocab_size=bs.vocab_size)
    cfg = with_lora(bs, cfg)  # --lora-rank: adapters on a random frozen base (``perf.bench``)
    settings = bs.resolved(cfg, layout)
    name = bs.config if bs.vocab_size is None else f"{bs.config} (vocab {bs.vocab_size})"
    from meshlm.perf.oom import reported

    # a device's out-of-memory, compiling or stepping: one line (``perf.oom``)
    with reported(lambda: bench_asked(bs.config, cfg, layout, settings)):
        report, text = _bench(bs, cfg, name, layout, settings)
    print0(json.dumps(report) if args.json else text(report))
    if bs.out and is_main() and text is _format:  # a --compare-* report has no bench.json or chart
        from meshlm.perf.bench_report import write_outputs

        write_outputs(report, bs.out)
    return 0


def _bench(bs, cfg, name, layout, settings) -> tuple[dict, Callable[[dict], str]]:
    """(the report, its text): a --compare-* comparison's, or the implementations' (with
    --memory-options, those too)."""
    if bs.compare_schedules:
        from meshlm.perf.bench_pp import compare_schedules, format_compare

        bs.check(cfg, layout)
        return compare_schedules(cfg, name, layout, settings), format_compare
    if bs.compare_window:
        from meshlm.perf.bench_window import compare_window, format_window

        bs.check(cfg, layout)
        return compare_window(cfg, name, layout, settings), format_window
    if bs.compare_linear:
        from meshlm.perf.bench_linear import compare_linear, format_linear

        bs.check(cfg, layout)
        return compare_linear(cfg, name, layout, settings), format_linear
    from meshlm.perf.bench import run_bench

    report = run_bench(cfg, name, layout, settings)
    if bs.memory_options:
        from meshlm.perf.memory_bench import memory_options_bench

        report["memory_options"] = memory_options_bench(cfg, layout, settings)
    return report, _format


def bench_asked(config: str, cfg, layout, settings):
    """The bench as an out-of-memory line names it, with its flags that cut memory: it holds every
    implementation's parameters and AdamW state at once (``copies``)."""
    from meshlm.perf.bench_settings import chosen, impl_names
    from meshlm.perf.oom import Asked

    compared = settings.compare_schedules or settings.compare_window or settings.compare_linear
    built = 1 if compared else len(chosen(settings, impl_names(cfg, layout)))
    cuts = [f"--impls meshlm (1 implementation's state, not {built})"] if built > 1 else []
    cuts += ["--remat full"] if settings.remat != "full" else []
    cuts += [
        "a smaller --batch-size",
        *(["--bf16 (16-bit activations)"] if settings.compute_dtype == "float32" else []),
    ]
    return Asked(
        "bench",
        config,
        cfg,
        layout,
        settings.batch_size,
        settings.seq_len,
        tuple(cuts),
        compute_dtype=settings.compute_dtype,
        opt_dtype=settings.opt_dtype,
        remat=settings.remat,
        copies=built,
    )
