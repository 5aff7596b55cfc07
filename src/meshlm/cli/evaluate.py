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
    checkpoint_model,
    flag_layout,
    refuse_options,
    settings_from,
    setup,
)
from meshlm.settings import MESH_OPTIONS, MeshFlags
from meshlm.train.eval_settings import EvalConfig, check_split

# The mesh options eval runs without (a checkpoint written under any of them loads on any mesh); it
# runs with --cp (the per-token losses gathered back over cp, ``parallel.cp.sequence_order``) and
# --ep (the experts split, rows over dp).
REFUSED = tuple(name for name in MESH_OPTIONS if name not in ("cp", "cp_strategy", "ep"))
PIPELINE = ("pp", "microbatches", "pp_schedule", "virtual_stages")


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="loss, perplexity and bits per byte of a checkpoint over a data set")
    add_common(p, None)
    add_flags(p, MeshFlags, "eval", REFUSED)
    add_flags(p, EvalConfig)
    p.set_defaults(fn=run)


def run(args) -> int:
    flags = settings_from(args, MeshFlags)
    refuse_options(args, flags, "eval", PIPELINE, ANY_MESH)  # --pp's line first, naming the mesh to use
    refuse_options(args, flags, "eval", REFUSED, ANY_MESH)
    ecfg = settings_from(args, EvalConfig)
    if planned := flag_layout(args, flags):  # before devices start
        planned.check_batch(ecfg.batch_size)
        if ecfg.seq_len:
            planned.check_seq_len(ecfg.seq_len)
    check_split(ecfg)  # before devices start
    layout = setup(args, flags, planned, model=lambda: checkpoint_model(ecfg.checkpoint))
    from meshlm.parallel.distributed import print0
    from meshlm.train.evaluation import evaluate

    t0 = time.perf_counter()
    result, source = evaluate(ecfg, layout)
    summary = {
        "checkpoint": args.checkpoint,
        "data": source,
        **result.to_json(),
        "mesh": layout.label(),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    if args.json:
        print0(json.dumps(summary))
    else:
        print0(
            f"loss {result.loss:.4f} nats/token, perplexity {result.perplexity:.3f}, "
            f"{result.bits_per_byte:.4f} bits/byte over {result.tokens:,} tokens ({result.bytes:,} bytes) "
            f"in {result.windows:,} windows of {result.seq_len} on a {layout.label()} mesh, "
            f"{summary['seconds']:.1f} s; data: {source}"
        )
    return 0
