"""meshlm launch: run a meshlm command as N local processes of one JAX distributed job."""

from __future__ import annotations

import argparse

from meshlm.cli.common import device_count, positive_int


def add_parser(sub) -> None:
    p = sub.add_parser(
        "launch",
        help="run a command as N local processes (JAX distributed runtime)",
        description="e.g. meshlm launch -n 2 --devices-per-process 2 -- verify --mesh 2x2",
    )
    p.add_argument(
        "-n", "--num-processes", type=positive_int, required=True, help="number of local processes"
    )
    p.add_argument(
        "--devices-per-process", type=device_count, default=2, help="fake CPU devices in each process"
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- <command> [args] (a meshlm subcommand)")
    p.set_defaults(fn=run)


def run(args) -> int:
    from meshlm.errors import DistributedError
    from meshlm.parallel.launch import main_launch

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise DistributedError("nothing to launch: give a command after --, e.g. -- verify --mesh 2x2")
    return main_launch(args.num_processes, args.devices_per_process, command)
