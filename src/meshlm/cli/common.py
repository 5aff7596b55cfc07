"""Flags every command shares, and the start-up order: devices, distributed runtime, mesh.

No JAX import at module level: ``--devices`` must set ``XLA_FLAGS`` before JAX starts.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from meshlm.errors import ConfigError
from meshlm.parallel.mesh import DEFAULT_DEVICES, MAX_HOST_DEVICES, force_host_devices, parse_mesh
from meshlm.ranges import (
    NON_NEGATIVE_FLOAT,
    NON_NEGATIVE_INT,
    POSITIVE_INT,
    PROBABILITY,
    Range,
)


def arg_type(valid: Range) -> Callable[[str], int | float]:
    """An argparse ``type=`` accepting only values in ``valid``: a bad flag is one line naming the flag
    and the range ("argument --lr: must be a finite number > 0, got -1.0"), exit code 2, before any work.
    """

    def parse(text: str) -> int | float:
        try:
            value = valid.kind(text)
        except ValueError:
            # argparse would otherwise print "invalid parse value", naming this function.
            raise argparse.ArgumentTypeError(f"must be {valid.describe()}, got {text!r}") from None
        if not valid.contains(value):
            raise argparse.ArgumentTypeError(f"must be {valid.describe()}, got {value!r}")
        return value

    parse.__name__ = valid.kind.__name__
    return parse


positive_int = arg_type(POSITIVE_INT)
non_negative_int = arg_type(NON_NEGATIVE_INT)
non_negative_float = arg_type(NON_NEGATIVE_FLOAT)
probability = arg_type(PROBABILITY)
# More fake devices than this is a typo: XLA would try to create them all and appear to hang.
device_count = arg_type(Range(int, 1, MAX_HOST_DEVICES))


def add_common(p: argparse.ArgumentParser, config: str | None = None) -> None:
    if config is not None:
        p.add_argument("--config", default=config, help="model preset name (see `meshlm configs`)")
    p.add_argument("--mesh", default=None, help="DPxMP, e.g. 1x4 or 2x2 (default: 1 x all devices)")
    p.add_argument(
        "--devices",
        type=device_count,
        default=None,
        help=f"fake host CPU devices (default {DEFAULT_DEVICES}; ignored on accelerators)",
    )
    p.add_argument("--seed", type=non_negative_int, default=0, help="random seed")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--coordinator", default=None, help="multi-process: HOST:PORT of process 0")
    p.add_argument("--num-processes", type=positive_int, default=None, help="multi-process: process count")
    p.add_argument(
        "--process-id", type=non_negative_int, default=None, help="multi-process: this process's index"
    )
    p.add_argument(
        "--init-timeout",
        type=positive_int,
        default=60,
        help="multi-process: seconds to wait for every process to join (and heartbeat timeout)",
    )


def check_batch_split(batch_size: int | None, mesh: str | None) -> None:
    """Refuse a --batch-size the --mesh cannot split, before devices and compilation: each of the dp
    data-parallel groups takes an equal share. Without --mesh, dp is 1 and any batch splits."""
    dp = parse_mesh(mesh)[0] if mesh else 1
    if batch_size is not None and batch_size % dp:
        raise ConfigError(
            f"--batch-size {batch_size} is not a multiple of dp={dp} (--mesh {mesh} is DPxMP); "
            f"use e.g. --batch-size {(batch_size // dp + 1) * dp}"
        )


def setup(args, default_dp: int = 1) -> tuple:
    """Devices, distributed runtime, mesh, in that order, before anything touches a device. A signal
    meanwhile is delivered once they are ready (``deferred_signals``).

    Returns (mesh, dp, mp). The default mesh is default_dp x (all devices / default_dp), or 1 x (all
    devices) when default_dp does not divide the device count.
    """
    from meshlm.train.stop import deferred_signals

    with deferred_signals():
        return _setup(args, default_dp)


def _setup(args, default_dp: int) -> tuple:
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
    n = jax.device_count()
    dp = default_dp if n % default_dp == 0 else 1
    dp, mp = parse_mesh(args.mesh) if args.mesh else (dp, n // dp)
    return make_mesh(dp, mp), dp, mp
