"""meshlm bench: time our sharded train step against the unsharded model and GSPMD, with MFU, memory
per device and collectives; see ``meshlm.perf.bench`` for what is measured and how."""

from __future__ import annotations

import json
from pathlib import Path

from meshlm.cli.common import add_common, flag_layout, non_negative_int, positive_int, setup
from meshlm.errors import ConfigError


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="step time, MFU, memory and collectives: meshlm vs unsharded vs GSPMD")
    add_common(p, "small")
    p.add_argument(
        "--batch-size", type=positive_int, default=None, help="global batch (default 4, a multiple of dp)"
    )
    p.add_argument(
        "--seq-len", type=positive_int, default=None, help="tokens per row (default min(256, max_seq_len))"
    )
    # The >= 5 floor is BenchSettings.check's (this module may not import meshlm.perf: it imports JAX).
    p.add_argument("--steps", type=positive_int, default=5, help="timed steps per implementation (>= 5)")
    p.add_argument(
        "--warmup", type=non_negative_int, default=1, help="untimed steps per implementation first"
    )
    p.add_argument(
        "--gen-tokens",
        type=non_negative_int,
        default=16,
        help="new tokens per row in the generation bench (0: skip)",
    )
    p.add_argument(
        "--peak-n",
        type=positive_int,
        default=2048,
        help="matmul size of the peak measurement (raise on accelerators)",
    )
    p.add_argument(
        "--unroll",
        type=non_negative_int,
        default=0,
        help="layers per iteration of the layer loop (0: all, the default; 1: a rolled loop)",
    )
    p.add_argument(
        "--vocab-size",
        type=positive_int,
        default=None,
        help="token ids of the model instead of the preset's (e.g. the main job's 1024-id BPE)",
    )
    p.add_argument("--out", default=None, help="also write bench.json and bench.png into this directory")
    p.add_argument(
        "--memory-options",
        action="store_true",
        help="also time FSDP and sequence parallelism against tensor parallelism and GSPMD",
    )
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
    check_out(args.out)
    if (layout := flag_layout(args)) and args.batch_size is not None:  # before devices and compiling
        layout.check_batch(args.batch_size)
    layout = setup(args)
    dp = layout.dp
    from meshlm.model.config import get_config
    from meshlm.parallel.distributed import is_main, print0
    from meshlm.perf.bench import DEFAULT_BATCH, DEFAULT_SEQ, BenchSettings, run_bench
    from meshlm.perf.bench_report import format_bench, write_outputs

    cfg = get_config(args.config).replace(unroll=args.unroll)
    if args.vocab_size is not None:  # the embedding and head follow (padded to vocab_multiple)
        cfg = cfg.replace(vocab_size=args.vocab_size)
    settings = BenchSettings(
        batch_size=args.batch_size or -(-DEFAULT_BATCH // dp) * dp,  # rounded up to a multiple of dp
        seq_len=args.seq_len or min(DEFAULT_SEQ, cfg.max_seq_len),
        steps=args.steps,
        warmup=args.warmup,
        seed=args.seed,
        gen_new_tokens=args.gen_tokens,
    )
    name = args.config if args.vocab_size is None else f"{args.config} (vocab {args.vocab_size})"
    report = run_bench(cfg, name, layout, settings, peak_n=args.peak_n)
    if args.memory_options:
        from meshlm.perf.memory_bench import memory_options_bench

        report["memory_options"] = memory_options_bench(cfg, layout, settings)
    print0(json.dumps(report) if args.json else _format(report, format_bench))
    if args.out and is_main():
        write_outputs(report, args.out)
    return 0
