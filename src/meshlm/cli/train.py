"""meshlm train: the main job. Defaults train the `cpu` preset on the Python stdlib in about 5 minutes.

The flags and the TrainConfig built from them are derived from TrainConfig's fields (see
``meshlm.train.config``): each flag is the field name in kebab case, and its value lands under the
field's own name in ``args``.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys

from meshlm.cli.common import add_common, add_flags, flag_layout, settings_from, setup
from meshlm.model.config import get_config
from meshlm.train.config import (
    DEFAULT_DP,
    DEFAULT_PRESET,
    TrainConfig,
    check_byte_vocab,
    check_compare,
    resolve,
)
from meshlm.train.lora import check_early, check_needs_base
from meshlm.train.stop import Stop

D = TrainConfig()


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train (or resume) a model; writes checkpoints and metrics to --out")
    # also --config and --seed (fields marked CLI_COMMON); --config defaults to "": the cpu preset, or
    # with --checkpoint the checkpoint's own model
    add_common(
        p,
        D.config,
        f"model preset (see `meshlm configs`; default: {DEFAULT_PRESET}); with --checkpoint "
        "the checkpoint's own model is trained and --config, if given, must name that model",
    )
    add_flags(p, TrainConfig)
    p.set_defaults(fn=run)


def train_config(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig the flags describe (each field not CLI-hidden is in ``args`` under its name)."""
    return settings_from(args, TrainConfig)


def run(args) -> int:
    stop = Stop()  # first: from here on SIGINT/SIGTERM are acted on at safe points (train.stop)
    try:
        return _run(args, stop)
    finally:
        stop.restore()


def _run(args, stop: Stop) -> int:
    tcfg, cfg = _preset_checks(train_config(args))
    # Without --mesh, the mesh depends on the device count: run.py checks once devices exist.
    if planned := flag_layout(args, tcfg):
        planned.check_batch(tcfg.batch_size, tcfg.accum_steps if tcfg.accum_steps > 1 else None)
        if cfg is not None:  # else the checkpoint's model: run.py checks it once read
            planned.check_seq_len(tcfg.seq_len)
            from meshlm.sharding.rules import check_uniform_stack  # imports JAX: here

            check_uniform_stack(cfg, planned)
    # the run uses this Layout as it is; without --mesh fitted to the run's model (``sharding.fit``)
    layout = setup(args, tcfg, planned, default_dp=DEFAULT_DP, model=lambda: _model(tcfg))
    stop.check_startup()
    from meshlm.parallel.distributed import print0
    from meshlm.perf.train_run import train

    summary = train(tcfg, layout, stop=stop)
    if args.json:
        print0(json.dumps(summary))
    elif "interrupted" not in summary:
        _print_summary(summary, print0)
    # 0 only for a finished run: interrupted (and saved) is 128 + the signal, as a shell reports it.
    return 128 + signal.Signals[summary["interrupted"]] if "interrupted" in summary else 0


def _model(tcfg: TrainConfig):
    """The run's model (``train.run.run_model``: the preset's, or --checkpoint's own)."""
    from meshlm.train.run import run_model

    return run_model(tcfg)[1]


def _preset_checks(tcfg: TrainConfig):
    """Before devices, data or model: a preset that cannot train on bytes fails in a second, not after
    the corpus is read. With --checkpoint the model is the checkpoint's (read with the devices, in
    ``train.run``): (tcfg, None), a --config name only checked to exist; its LoRA flags checked
    against its model's meta (``train.lora.check_early``)."""
    check_needs_base(tcfg)
    check_early(tcfg, tcfg.checkpoint, tcfg.config)
    check_compare(tcfg.compare, tcfg.out)
    if tcfg.checkpoint:
        if tcfg.config:
            get_config(tcfg.config)
        return tcfg, None
    tcfg, cfg = resolve(tcfg)
    check_byte_vocab(tcfg, cfg)
    return tcfg, cfg


def _print_summary(summary: dict, print0) -> None:
    if summary.get("sample"):
        print0("--- sample ---\n" + summary["sample"] + "\n--------------")
    name = "val_bpb" if summary["val_bpb_end"] is not None else "val_loss"  # DPO: its loss
    start = summary[f"{name}_start"]
    print0(
        f"done: step {summary['step']} in {summary['wall_s']:.0f} s; {name} "
        f"{'' if start is None else f'{start:.3f} -> '}{summary[f'{name}_end']:.3f}; "
        f"outputs in {summary['out']}",
        file=sys.stderr,
    )
    if summary.get("next"):
        print0(
            "next: sample, prove the sharding with these weights, measure on the validation split:",
            file=sys.stderr,
        )
        print0("\n".join(f"  {line}" for line in summary["next"]), file=sys.stderr)
