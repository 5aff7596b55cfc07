"""meshlm eval: a checkpoint's loss, perplexity and bits per byte over a whole data set, on any mesh.

Every token of the set is predicted once (non-overlapping windows, the last partial one included; no
sampling): see ``meshlm.train.evaluation``.
"""

from __future__ import annotations

import json
import time

from meshlm.cli.common import (
    add_common,
    add_flags,
    add_refused_pp,
    flag_layout,
    positive_int,
    refuse_pp,
    settings_from,
    setup,
)
from meshlm.errors import ConfigError
from meshlm.train.eval_settings import EvalConfig, check_split


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="loss, perplexity and bits per byte of a checkpoint over a data set")
    add_common(p, None)
    add_refused_pp(p, "eval")
    p.add_argument(
        "--cp", type=positive_int, default=1, help="refused: eval runs without context parallelism"
    )
    add_flags(p, EvalConfig)
    p.set_defaults(fn=run)


def refuse_cp(args) -> None:
    """One line instead of an unknown flag: the per-token losses are not yet gathered back over cp."""
    if args.cp > 1:
        raise ConfigError(
            f"meshlm eval has no context parallelism yet (--cp {args.cp}: its per-token losses are not "
            "gathered back over cp); checkpoints do not depend on cp: drop --cp"
        )


def run(args) -> int:
    refuse_pp(args, "eval")
    refuse_cp(args)
    ecfg = settings_from(args, EvalConfig)
    check_split(ecfg)  # before devices start
    if layout := flag_layout(args):  # before devices start
        layout.check_batch(ecfg.batch_size)
    layout = setup(args)
    from meshlm.parallel.distributed import print0
    from meshlm.train.evaluation import evaluate

    t0 = time.perf_counter()
    result, source = evaluate(ecfg, layout)
    summary = {
        "checkpoint": args.checkpoint,
        "data": source,
        **result.to_json(),
        "mesh": f"{layout.dp}x{layout.mp}",
        "seconds": round(time.perf_counter() - t0, 2),
    }
    if args.json:
        print0(json.dumps(summary))
    else:
        print0(
            f"loss {result.loss:.4f} nats/token, perplexity {result.perplexity:.3f}, "
            f"{result.bits_per_byte:.4f} bits/byte over {result.tokens:,} tokens ({result.bytes:,} bytes) "
            f"in {result.windows:,} windows of {result.seq_len} on a {layout.dp}x{layout.mp} mesh, "
            f"{summary['seconds']:.1f} s; data: {source}"
        )
    return 0
