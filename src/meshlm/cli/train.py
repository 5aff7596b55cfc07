"""meshlm train: the main job. Defaults train the `cpu` preset on the Python stdlib in about 5 minutes."""

from __future__ import annotations

import json
import sys

from meshlm.cli.common import add_common, setup
from meshlm.train.config import TrainConfig

D = TrainConfig()


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train (or resume) a model; writes checkpoints and metrics to --out")
    add_common(p, D.config)
    p.add_argument(
        "--data", nargs="+", default=None, help="text files, directories or globs (default: stdlib)"
    )
    for flag, kind in (
        ("steps", int),
        ("batch-size", int),
        ("seq-len", int),
        ("lr", float),
        ("warmup-steps", int),
        ("weight-decay", float),
        ("clip-norm", float),
        ("accum-steps", int),
        ("eval-every", int),
        ("eval-batches", int),
        ("save-every", int),
        ("keep", int),
        ("log-every", int),
        ("sample-tokens", int),
    ):
        name = flag.replace("-", "_")
        p.add_argument(f"--{flag}", type=kind, default=getattr(D, name), help=f"default {getattr(D, name)}")
    p.add_argument("--bf16", action="store_true", help="bf16 compute with float32 master weights")
    p.add_argument(
        "--out", default=D.out, help=f"run directory (default {D.out}); resumes if it has checkpoints"
    )
    p.add_argument("--fresh", action="store_true", help="start over; refuses if --out holds checkpoints")
    p.add_argument(
        "--checkpoint", default="", help="initial parameters from a checkpoint (e.g. converted HF)"
    )
    p.set_defaults(fn=run)


def run(args) -> int:
    mesh, _, _ = setup(args)
    from meshlm.parallel.distributed import print0
    from meshlm.train.loop import train

    tcfg = TrainConfig(
        config=args.config,
        data=tuple(args.data or ()),
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay,
        clip_norm=args.clip_norm,
        accum_steps=args.accum_steps,
        compute_dtype="bfloat16" if args.bf16 else "float32",
        eval_every=args.eval_every,
        eval_batches=args.eval_batches,
        save_every=args.save_every,
        keep=args.keep,
        log_every=args.log_every,
        seed=args.seed,
        out=args.out,
        fresh=args.fresh,
        checkpoint=args.checkpoint,
        sample_tokens=args.sample_tokens,
    )
    summary = train(tcfg, mesh)
    if args.json:
        print0(json.dumps(summary))
    elif "interrupted" not in summary:
        if summary.get("sample"):
            print0("--- sample ---\n" + summary["sample"] + "\n--------------")
        start = summary["val_bpb_start"]
        print0(
            f"done: step {summary['step']} in {summary['wall_s']:.0f} s; val_bpb "
            f"{'' if start is None else f'{start:.3f} -> '}{summary['val_bpb_end']:.3f}; "
            f"outputs in {summary['out']}",
            file=sys.stderr,
        )
    return 0
