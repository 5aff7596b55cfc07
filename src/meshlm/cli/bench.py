"""meshlm bench: time our sharded train step against the unsharded model and GSPMD, with MFU, memory
per device and collectives; see ``meshlm.perf.bench`` for what is measured and how."""

from __future__ import annotations

import json

from meshlm.cli.common import add_common, setup


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="step time, MFU, memory and collectives: meshlm vs unsharded vs GSPMD")
    add_common(p, "small")
    p.add_argument("--batch-size", type=int, default=None, help="global batch (default 4, a multiple of dp)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per row (default min(256, max_seq_len))")
    p.add_argument("--steps", type=int, default=5, help="timed steps per implementation (>= 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per implementation first")
    p.add_argument(
        "--gen-tokens", type=int, default=16, help="new tokens per row in the generation bench (0: skip)"
    )
    p.add_argument(
        "--peak-n", type=int, default=2048, help="matmul size of the peak measurement (raise on accelerators)"
    )
    p.add_argument("--out", default=None, help="also write bench.json and bench.png into this directory")
    p.set_defaults(fn=run)


def run(args) -> int:
    mesh, dp, _ = setup(args)
    from meshlm.model.config import get_config
    from meshlm.parallel.distributed import is_main, print0
    from meshlm.perf.bench import DEFAULT_BATCH, DEFAULT_SEQ, BenchSettings, run_bench
    from meshlm.perf.bench_report import format_bench, write_outputs

    cfg = get_config(args.config)
    settings = BenchSettings(
        batch_size=args.batch_size or -(-DEFAULT_BATCH // dp) * dp,  # rounded up to a multiple of dp
        seq_len=args.seq_len or min(DEFAULT_SEQ, cfg.max_seq_len),
        steps=args.steps,
        warmup=args.warmup,
        seed=args.seed,
        gen_new_tokens=args.gen_tokens,
    )
    report = run_bench(cfg, args.config, mesh, settings, peak_n=args.peak_n)
    print0(json.dumps(report) if args.json else format_bench(report))
    if args.out and is_main():
        write_outputs(report, args.out)
    return 0
