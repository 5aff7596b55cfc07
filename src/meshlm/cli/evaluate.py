"""meshlm eval: a checkpoint's loss, perplexity and bits per byte over a whole data set, on any mesh.

Every token of the set is predicted once (non-overlapping windows, the last partial one included; no
sampling): see ``meshlm.train.evaluation``.
"""

from __future__ import annotations

import json
import time

from meshlm.cli.common import (
    ANY_MESH,
    add_common,
    add_flags,
    flag_layout,
    refuse_options,
    settings_from,
    setup,
)
from meshlm.errors import ConfigError
from meshlm.settings import MESH_OPTIONS, MeshFlags
from meshlm.train.eval_settings import EvalConfig, check_split

# The mesh options eval runs without (a checkpoint written under any of them loads on any mesh).
REFUSED = tuple(o for o in MESH_OPTIONS if o != "ep")  # --ep: the experts split, rows over dp
PIPELINE = ("pp", "microbatches", "pp_schedule", "virtual_stages")


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="loss, perplexity and bits per byte of a checkpoint over a data set")
    add_common(p, None)
    add_flags(p, MeshFlags, "eval", REFUSED)
    add_flags(p, EvalConfig)
    p.set_defaults(fn=run)


def refuse_cp(flags: MeshFlags) -> None:
    """One line instead of an unknown flag: the per-token losses are not yet gathered back over cp."""
    if flags.cp > 1:
        raise ConfigError(
            f"meshlm eval has no context parallelism yet (--cp {flags.cp}: its per-token losses are not "
            "gathered back over cp); checkpoints do not depend on cp: drop --cp"
        )


def run(args) -> int:
    flags = settings_from(args, MeshFlags)
    refuse_options(args, flags, "eval", PIPELINE, ANY_MESH)  # --pp's line before --cp's, as before
    refuse_cp(flags)  # eval's own line for --cp
    refuse_options(args, flags, "eval", REFUSED, ANY_MESH)
    ecfg = settings_from(args, EvalConfig)
    check_split(ecfg)  # before devices start
    if planned := flag_layout(args, flags):  # before devices start
        planned.check_batch(ecfg.batch_size)
    layout = setup(args, flags, planned)
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
