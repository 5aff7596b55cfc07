"""Flags every command shares, and the start-up order: devices, distributed runtime, mesh.

No JAX import at module level: ``--devices`` must set ``XLA_FLAGS`` before JAX starts.
"""

from __future__ import annotations

import argparse
import os
import sys

from meshlm.parallel.mesh import DEFAULT_DEVICES, force_host_devices, parse_mesh


def add_common(p: argparse.ArgumentParser, config: str | None = None) -> None:
    if config is not None:
        p.add_argument("--config", default=config, help="model preset name (see `meshlm configs`)")
    p.add_argument("--mesh", default=None, help="DPxMP, e.g. 1x4 or 2x2 (default: 1 x all devices)")
    p.add_argument(
        "--devices",
        type=int,
        default=None,
        help=f"fake host CPU devices (default {DEFAULT_DEVICES}; ignored on accelerators)",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--coordinator", default=None, help="multi-process: HOST:PORT of process 0")
    p.add_argument("--num-processes", type=int, default=None, help="multi-process: process count")
    p.add_argument("--process-id", type=int, default=None, help="multi-process: this process's index")
    p.add_argument(
        "--init-timeout",
        type=int,
        default=60,
        help="multi-process: seconds to wait for every process to join (and heartbeat timeout)",
    )


def setup(args) -> tuple:
    """Devices, distributed runtime, mesh, in that order, before anything touches a device.

    Returns (mesh, dp, mp). The default mesh is 1 x (all devices).
    """
    force_host_devices(args.devices if args.devices is not None else DEFAULT_DEVICES)
    if args.coordinator or args.num_processes:
        # Seen here: with a persistent compilation cache, processes of one job can disagree on
        # which programs they load or compile and deadlock in a collective. Compile afresh instead.
        os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
    from meshlm.parallel import distributed

    distributed.initialize(
        args.coordinator, args.num_processes, args.process_id, init_timeout_s=args.init_timeout
    )
    import jax

    from meshlm.parallel.mesh import accelerator_note, make_mesh

    if args.devices is not None and (note := accelerator_note()):
        print(note, file=sys.stderr)
    dp, mp = parse_mesh(args.mesh) if args.mesh else (1, jax.device_count())
    return make_mesh(dp, mp), dp, mp
