"""A tiny multi-process program for tests/test_distributed.py, started by ``meshlm.launch``.

It takes the flags the launcher appends (``--coordinator --num-processes --process-id
--devices``) like the real CLI, joins the job, and runs one cross-process psum.
"""

import argparse
import os
import sys
import time


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--coordinator")
    parser.add_argument("--num-processes", type=int)
    parser.add_argument("--process-id", type=int)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--init-timeout", type=int, default=20)
    # spin: psum until killed (a peer to freeze); linger: process 0 stays 3 timeouts after the psum
    # while its peer exits at once (a finished peer must not be reported as frozen).
    modes = ["psum", "fail", "raise", "sleep", "spin", "linger"]
    parser.add_argument("--mode", choices=modes, default="psum")
    parser.add_argument("--fail-process", type=int, default=1)
    parser.add_argument("--fail-code", type=int, default=3)
    parser.add_argument("--pid-dir")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    # The device count must be fixed before jax is imported.
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    if args.pid_dir:
        with open(os.path.join(args.pid_dir, f"{args.process_id}.pid"), "w") as f:
            f.write(str(os.getpid()))
    if args.mode == "sleep":
        print(f"sleeping {args.process_id}", flush=True)
        time.sleep(120)
    from meshlm.parallel import distributed

    distributed.initialize(
        args.coordinator, args.num_processes, args.process_id, init_timeout_s=args.init_timeout
    )
    print(f"hello from {args.process_id}", flush=True)
    print(f"stderr from {args.process_id}", file=sys.stderr, flush=True)
    if args.process_id == args.fail_process:
        if args.mode == "fail":
            distributed.exit_process(args.fail_code)
        if args.mode == "raise":
            raise RuntimeError("worker failed on purpose")
    result = psum_everything()
    while args.mode == "spin":
        psum_everything()
        time.sleep(0.1)
    distributed.print0("RESULT", result)
    if args.mode == "linger" and args.process_id == 0:
        time.sleep(3 * args.init_timeout)


def psum_everything() -> list:
    """Sum a 4x4 array sharded over a 2x2 mesh of all global devices, over both mesh axes."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("dp", "mp"))
    value = np.arange(16.0, dtype=np.float32).reshape(4, 4)
    x = jax.make_array_from_callback(value.shape, NamedSharding(mesh, P("dp", "mp")), value.__getitem__)
    total = jax.shard_map(
        lambda a: jax.lax.psum(a, ("dp", "mp")), mesh=mesh, in_specs=P("dp", "mp"), out_specs=P()
    )
    y = jax.jit(total)(x)
    # out_specs=P(): every device holds the whole (replicated) result.
    return np.asarray(y.addressable_data(0)).tolist()


if __name__ == "__main__":
    main()
