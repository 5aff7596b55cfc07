"""The ``meshlm`` command line: each subcommand is a short function that builds a config and calls
the library. JAX is imported only after ``--devices`` has set ``XLA_FLAGS`` and, for multi-process
runs, after the distributed runtime is initialised."""

from __future__ import annotations

import argparse
import json
import sys

from meshlm.devices import DEFAULT_DEVICES, force_host_devices, parse_mesh
from meshlm.errors import MeshlmError


def _common(p: argparse.ArgumentParser, config: str) -> None:
    p.add_argument("--config", default=config, help="model preset name (see `meshlm configs`)")
    p.add_argument("--mesh", default=None, help="DPxMP, e.g. 1x4 or 2x2 (default: 1 x all devices)")
    p.add_argument("--devices", type=int, default=None,
                   help=f"fake host CPU devices (default {DEFAULT_DEVICES}; ignored on accelerators)")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--coordinator", default=None, help="multi-process: HOST:PORT of process 0")
    p.add_argument("--num-processes", type=int, default=None, help="multi-process: process count")
    p.add_argument("--process-id", type=int, default=None, help="multi-process: this process")


def _setup(args) -> tuple:
    """Devices, distributed runtime, mesh: in that order, before anything touches a device."""
    force_host_devices(args.devices if args.devices is not None else DEFAULT_DEVICES)
    from meshlm import distributed

    distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    import jax

    from meshlm.devices import accelerator_note, make_mesh

    if args.devices is not None and (note := accelerator_note()):
        print(note, file=sys.stderr)
    dp, mp = parse_mesh(args.mesh) if args.mesh else (1, jax.device_count())
    return make_mesh(dp, mp), dp, mp


def cmd_verify(args) -> int:
    mesh, dp, mp = _setup(args)
    import jax
    import jax.numpy as jnp

    from meshlm.config import get_config
    from meshlm.distributed import print0
    from meshlm.proof import format_report, model_problem, verify

    if args.x64:
        jax.config.update("jax_enable_x64", True)
    cfg = get_config(args.config)
    problem = model_problem(cfg, args.config, mp, args.batch_size or 2 * dp, args.seq_len, args.seed)
    report = verify(problem, mesh, steps=args.steps, dtype=jnp.float64 if args.x64 else jnp.float32,
                    seed=args.seed)
    print0(json.dumps(report.to_json()) if args.json else format_report(report))
    return 0 if report.ok else 1


def cmd_configs(args) -> int:
    from meshlm.config import PRESETS

    for name, cfg in PRESETS.items():
        print(f"{name:<11} {cfg.to_json()}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshlm", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("verify", help="prove sharded == unsharded for every parameter")
    _common(p, "seed")
    p.add_argument("--steps", type=int, default=0, help="also compare K full training steps")
    p.add_argument("--x64", action="store_true", help="float64: worst relative error must be <= 1e-12")
    p.add_argument("--batch-size", type=int, default=None, help="global batch (default 2 x dp)")
    p.add_argument("--seq-len", type=int, default=64, help="sequence length")
    p.set_defaults(fn=cmd_verify)
    p = sub.add_parser("configs", help="list the model presets")
    p.set_defaults(fn=cmd_configs)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except MeshlmError as e:
        print(f"meshlm: error: {e}", file=sys.stderr)
        return 2
