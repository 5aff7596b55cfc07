"""meshlm verify: prove the sharded model equals the unsharded one, parameter by parameter."""

from __future__ import annotations

import dataclasses
import json
import sys

from meshlm.cli.common import (
    add_common,
    arg_type,
    check_batch_split,
    non_negative_float,
    positive_int,
    setup,
)
from meshlm.model.config import REMAT
from meshlm.ranges import Range

# One token attends only to itself: the causal mask and attention across positions would go unproven
# (and 0 tokens give a NaN loss, reported as a FAIL).
MIN_SEQ_LEN = 2
DATA_STEPS = 3  # steps of the data-pipeline check (cheap: host arrays only)
# Each proof step runs sharded and unsharded and compares every leaf: 10,000 is hours; more is a typo.
MAX_PROOF_STEPS = Range(int, 0, 10_000)


def add_parser(sub) -> None:
    p = sub.add_parser("verify", help="prove sharded == unsharded for every parameter")
    add_common(p, "seed")
    p.add_argument(
        "--steps",
        type=arg_type(MAX_PROOF_STEPS),
        default=0,
        help=f"also compare K full training steps (K <= {MAX_PROOF_STEPS.high:g}: each runs sharded and not)",
    )
    p.add_argument("--x64", action="store_true", help="float64: worst relative error must be <= 1e-12")
    p.add_argument(
        "--batch-size",
        type=positive_int,
        default=None,
        help="global batch, a multiple of dp (default 2 x dp)",
    )
    p.add_argument(
        "--seq-len", type=arg_type(Range(int, MIN_SEQ_LEN)), default=64, help="sequence length (>= 2)"
    )
    p.add_argument("--checkpoint", default=None, help="prove with these parameters (run dir or step dir)")
    p.add_argument(
        "--z-loss", type=non_negative_float, default=None, help="prove with this z-loss coefficient"
    )
    p.add_argument(
        "--no-collectives",
        dest="collectives",
        action="store_false",
        help="skip the communication check (compiling the train step and counting its collectives)",
    )
    p.add_argument("--fsdp", action="store_true", help="prove FSDP: weights and moments split over dp")
    p.add_argument("--sp", action="store_true", help="prove sequence parallelism over mp")
    p.add_argument(
        "--remat",
        choices=REMAT,
        default=None,
        help="prove with this recomputation policy (default: the config's)",
    )
    p.add_argument("--matrix", action="store_true", help="prove every preset x mesh x option that fits")
    p.add_argument("--md", action="store_true", help="with --matrix: print the table as markdown")
    p.set_defaults(fn=run)


def run(args) -> int:
    from meshlm.errors import VERIFIER_EXIT_CODE, VerifierError

    check_batch_split(args.batch_size, args.mesh)
    _check_sp(args)
    try:
        return _matrix(args) if args.matrix else _verify(args)
    except VerifierError as e:
        print(f"meshlm: verifier error: {e}", file=sys.stderr)
        return VERIFIER_EXIT_CODE


def _check_sp(args) -> None:
    """--sp splits the sequence over mp: refuse a --seq-len it cannot split, before any work."""
    from meshlm.errors import ConfigError
    from meshlm.parallel.mesh import parse_mesh

    mp = parse_mesh(args.mesh)[1] if args.mesh else None
    if args.sp and mp and args.seq_len % mp:
        raise ConfigError(
            f"--sp splits the sequence over mp={mp}, but --seq-len {args.seq_len} is not divisible "
            f"by it; use a multiple of {mp}"
        )


def _matrix(args) -> int:
    import os
    import tempfile

    # Before JAX starts (setup): see meshlm.proof.matrix for why these are safe and worth it.
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    setup(args)
    import jax

    if not jax.config.jax_compilation_cache_dir:  # a cache for this run only, removed at exit
        cache = tempfile.TemporaryDirectory(prefix="meshlm-verify-matrix-")
        jax.config.update("jax_compilation_cache_dir", cache.name)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

    from meshlm.parallel.distributed import print0
    from meshlm.proof.matrix import format_matrix, run_matrix

    if args.x64:
        jax.config.update("jax_enable_x64", True)
    rows = run_matrix(jax.device_count(), x64=args.x64, steps=args.steps, seed=args.seed)
    print0(json.dumps(rows) if args.json else format_matrix(rows, markdown=args.md))
    return 0 if all(r["ok"] in (True, None) for r in rows) else 1


def _verify(args) -> int:
    mesh, dp, mp = setup(args)
    import jax
    import jax.numpy as jnp

    from meshlm.model.config import get_config
    from meshlm.parallel.distributed import print0
    from meshlm.proof import format_report, model_problem, verify

    if args.x64:
        jax.config.update("jax_enable_x64", True)
    cfg, name = get_config(args.config), args.config
    if args.checkpoint:
        from meshlm.io.model_io import load_model, read_config

        cfg, name = read_config(args.checkpoint)[0], args.checkpoint
        _check_tokenizer(args.checkpoint, print0)
    if args.z_loss is not None:
        cfg = cfg.replace(z_loss=args.z_loss)
    if args.remat is not None:
        cfg = cfg.replace(remat=args.remat)
    batch = args.batch_size if args.batch_size is not None else 2 * dp
    seq_len = min(args.seq_len, cfg.max_seq_len)
    problem = model_problem(cfg, name, mp, batch, seq_len, args.seed, dp=dp, fsdp=args.fsdp, sp=args.sp)
    if args.checkpoint:
        problem = dataclasses.replace(problem, load_params=lambda m: load_model(args.checkpoint, m)[1])
    dtype = jnp.float64 if args.x64 else jnp.float32
    report = verify(
        problem,
        mesh,
        steps=args.steps,
        dtype=dtype,
        seed=args.seed,
        collectives=args.collectives,
        data_steps=3,
    )
    print0(json.dumps(report.to_json()) if args.json else format_report(report))
    return 0 if report.ok else 1


def _check_tokenizer(checkpoint: str, print0) -> None:
    """The checkpoint's tokenizer must load, match its SHA-256 and fit the model's vocabulary."""
    import sys

    from meshlm.train.tokenizers import checkpoint_tokenizer

    tok = checkpoint_tokenizer(checkpoint, required=False)
    print0(f"tokenizer: {tok.describe() if tok else 'none (token ids only)'}", file=sys.stderr)
