"""meshlm eval: a checkpoint's loss, perplexity and bits per byte over a whole data set, on any mesh.

Every token of the set is predicted once (non-overlapping windows, the last partial one included; no
sampling): see ``meshlm.train.evaluation``.
"""

from __future__ import annotations

import json
import time

from meshlm.cli.common import add_common, check_batch_split, non_negative_int, positive_int, setup


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="loss, perplexity and bits per byte of a checkpoint over a data set")
    add_common(p, None)
    p.add_argument("--checkpoint", required=True, help="run directory (newest step) or one step's directory")
    p.add_argument(
        "--data",
        nargs="+",
        required=True,
        help="text, .jsonl(.gz/.zst), .parquet files, directories or globs (all of it), or a token store",
    )
    p.add_argument(
        "--split", default="val", choices=("train", "val"), help="a token store's split (default val)"
    )
    p.add_argument(
        "--seq-len",
        type=non_negative_int,
        default=0,
        help="tokens per window (default: the model's max_seq_len)",
    )
    p.add_argument(
        "--batch-size", type=positive_int, default=8, help="windows per step, split over dp (default 8)"
    )
    p.add_argument(
        "--text-field", default="text", help="the text field of JSONL / Parquet rows (default text)"
    )
    p.add_argument(
        "--tokenizer",
        default="",
        help="tokenizer.json for a checkpoint converted without one (default: its own)",
    )
    p.set_defaults(fn=run)


def run(args) -> int:
    from meshlm.train.evaluation import EvalConfig

    ecfg = EvalConfig(
        checkpoint=args.checkpoint,
        data=tuple(args.data),
        split=args.split,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        text_field=args.text_field,
        tokenizer=args.tokenizer,
    )
    check_batch_split(args.batch_size, args.mesh)
    mesh, dp, mp = setup(args)
    from meshlm.parallel.distributed import print0
    from meshlm.train.evaluation import evaluate

    t0 = time.perf_counter()
    result, source = evaluate(ecfg, mesh)
    summary = {
        "checkpoint": args.checkpoint,
        "data": source,
        **result.to_json(),
        "mesh": f"{dp}x{mp}",
        "seconds": round(time.perf_counter() - t0, 2),
    }
    if args.json:
        print0(json.dumps(summary))
    else:
        print0(
            f"loss {result.loss:.4f} nats/token, perplexity {result.perplexity:.3f}, "
            f"{result.bits_per_byte:.4f} bits/byte over {result.tokens:,} tokens ({result.bytes:,} bytes) "
            f"in {result.windows:,} windows of {result.seq_len} on a {dp}x{mp} mesh, "
            f"{summary['seconds']:.1f} s; data: {source}"
        )
    return 0
