"""meshlm train: the main job. Defaults train the `cpu` preset on the Python stdlib in about 5 minutes.

The flags and the TrainConfig built from them are derived from TrainConfig's fields (see
``meshlm.train.config``): each flag is the field name in kebab case, and its value lands under the
field's own name in ``args``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys

from meshlm.cli.common import add_common, arg_type, check_batch_split, setup
from meshlm.parallel.mesh import parse_mesh
from meshlm.train.config import (
    CLI_FLAG,
    CLI_HIDDEN,
    DEFAULT_DP,
    TrainConfig,
    check_byte_vocab,
    check_seq_split,
    resolve,
)
from meshlm.train.stop import Stop

D = TrainConfig()


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train (or resume) a model; writes checkpoints and metrics to --out")
    add_common(p, D.config)  # also --config and --seed (fields marked CLI_COMMON)
    for f in dataclasses.fields(TrainConfig):
        if f.metadata["cli"] == CLI_FLAG:
            _add_flag(p, f)
    p.set_defaults(fn=run)


def _add_flag(p: argparse.ArgumentParser, f: dataclasses.Field) -> None:
    switch = f.metadata["switch"]
    if switch is not None:
        # Under the field's own dest, like every other flag, so `train_config` needs no special case.
        p.add_argument(switch.flag, dest=f.name, action="store_const", const=switch.value, help=switch.help)
        p.set_defaults(**{f.name: f.default})
        return
    flag = "--" + f.name.replace("_", "-")
    if isinstance(f.default, bool):
        p.add_argument(flag, action="store_true", help=_help(f))
    elif isinstance(f.default, tuple):
        p.add_argument(flag, nargs="+", default=f.default, help=_help(f))
    else:
        valid = f.metadata["valid"]
        kind = arg_type(valid) if valid is not None else type(f.default)
        p.add_argument(flag, type=kind, default=f.default, choices=f.metadata["choices"], help=_help(f))


def _help(f: dataclasses.Field) -> str:
    """The field's help, with its default unless that is empty (or a flag without a value)."""
    shown = f.metadata["shown_default"]
    if shown is None and f.default not in ("", ()) and not isinstance(f.default, bool):
        shown = f.default
    text = f.metadata["help"] if shown is None else f"{f.metadata['help']} (default: {shown})"
    return text.replace("%", "%%")  # argparse formats help with %


def train_config(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig the flags describe (each field not CLI-hidden is in ``args`` under its name)."""
    values = {}
    for f in dataclasses.fields(TrainConfig):
        if f.metadata["cli"] != CLI_HIDDEN:
            value = getattr(args, f.name)
            values[f.name] = tuple(value) if isinstance(f.default, tuple) else value
    return TrainConfig(**values)


def run(args) -> int:
    stop = Stop()  # first: from here on SIGINT/SIGTERM are acted on at safe points (train.stop)
    try:
        return _run(args, stop)
    finally:
        stop.restore()


def _run(args, stop: Stop) -> int:
    tcfg, cfg = resolve(train_config(args))
    # Before devices, data or model: a preset that cannot train on bytes fails in a second, not after
    # the corpus is read.
    check_byte_vocab(tcfg, cfg)
    if tcfg.accum_steps == 1:  # with accumulation, run.py names the micro-batch size it cannot split
        check_batch_split(tcfg.batch_size, args.mesh)
    if args.mesh:  # without --mesh, mp is the device count: run.py checks once devices exist
        check_seq_split(tcfg, parse_mesh(args.mesh)[1])
    mesh, _, _ = setup(args, default_dp=DEFAULT_DP)
    stop.check_startup()
    from meshlm.parallel.distributed import print0
    from meshlm.train.loop import train

    summary = train(tcfg, mesh, stop=stop)
    if args.json:
        print0(json.dumps(summary))
    elif "interrupted" not in summary:
        _print_summary(summary, print0)
    # 0 only for a finished run: interrupted (and saved) is 128 + the signal, as a shell reports it.
    return 128 + signal.Signals[summary["interrupted"]] if "interrupted" in summary else 0


def _print_summary(summary: dict, print0) -> None:
    if summary.get("sample"):
        print0("--- sample ---\n" + summary["sample"] + "\n--------------")
    start = summary["val_bpb_start"]
    print0(
        f"done: step {summary['step']} in {summary['wall_s']:.0f} s; val_bpb "
        f"{'' if start is None else f'{start:.3f} -> '}{summary['val_bpb_end']:.3f}; "
        f"outputs in {summary['out']}",
        file=sys.stderr,
    )
