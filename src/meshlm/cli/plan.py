"""meshlm plan: one device's memory for a training run, from the real train step compiled ahead of time
on abstract shapes (nothing of the model is allocated), next to an analytic estimate; with
--device-memory, whether it fits and which options would make it fit. See ``meshlm.perf.plan``."""

from __future__ import annotations

import argparse
import json
import math
import os
import re

from meshlm.cli.common import add_common, positive_int, setup
from meshlm.errors import ConfigError
from meshlm.parallel.mesh import parse_mesh

REMAT_CHOICES = ("none", "full", "selective")  # perf.activations.REMAT_POLICIES (no JAX import here)
UNITS = {"TiB": 2**40, "GiB": 2**30, "MiB": 2**20, "TB": 10**12, "GB": 10**9, "MB": 10**6}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]+)\s*")


def memory_size(text: str) -> int:
    """Bytes of "80GiB", "80 GB", "512MiB" (GiB/MiB/TiB powers of 2, GB/MB/TB powers of 10)."""
    match = _SIZE.fullmatch(text)
    units = {u.lower(): n for u, n in UNITS.items()}
    if not match or match.group(2).lower() not in units:
        raise argparse.ArgumentTypeError(
            f"must be a size with a unit ({', '.join(UNITS)}), e.g. 80GiB, got {text!r}"
        )
    size = float(match.group(1)) * units[match.group(2).lower()]
    if not math.isfinite(size) or size < 1:
        raise argparse.ArgumentTypeError(f"must be a positive size, e.g. 80GiB, got {text!r}")
    return int(size)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "plan", help="memory per device of a training run: compiled ahead of time, and whether it fits"
    )
    p.add_argument(
        "--config", default=None, help="model preset name (default llama2-7b; see `meshlm configs`)"
    )
    p.add_argument("--checkpoint", default=None, help="plan the model of this checkpoint instead of --config")
    add_common(p)  # --devices defaults to the --mesh's size here: the planner runs nothing
    p.add_argument(
        "--batch-size", type=positive_int, default=8, help="global batch rows per step (default 8)"
    )
    p.add_argument("--seq-len", type=positive_int, default=None, help="tokens per row (default max_seq_len)")
    p.add_argument("--accum-steps", type=positive_int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--bf16", action="store_true", help="bf16 compute with float32 master weights")
    p.add_argument("--fsdp", action="store_true", help="also shard weights and AdamW state over dp")
    p.add_argument("--sp", action="store_true", help="sequence parallelism over mp")
    p.add_argument(
        "--remat", choices=REMAT_CHOICES, default=None, help="rematerialisation (default: the config's own)"
    )
    p.add_argument(
        "--device-memory",
        type=memory_size,
        default=None,
        help="memory of one device, e.g. 80GiB: say whether the run fits and search options that do",
    )
    p.add_argument(
        "--max-compiles",
        type=positive_int,
        default=8,
        help="most step compiles, the given settings and the candidates together (default 8)",
    )
    p.add_argument(
        "--every-option",
        action="store_true",
        help="try each option alone, not only up to the cheapest that fits (more compiles)",
    )
    p.set_defaults(fn=run)


def _preset(args):
    """(config, its name) of a preset (no JAX needed), or None for a checkpoint's model."""
    from meshlm.model.config import get_config

    if args.checkpoint is None:
        name = args.config or "llama2-7b"
        return get_config(name), name
    if args.config is not None:
        raise ConfigError("give --config or --checkpoint, not both (a checkpoint names its own model)")
    return None


def _settings(args, cfg):
    from meshlm.perf.plan_settings import PlanSettings, remat_policy

    return PlanSettings(
        batch_size=args.batch_size,
        seq_len=args.seq_len or cfg.max_seq_len,
        accum_steps=args.accum_steps,
        compute_dtype="bfloat16" if args.bf16 else "float32",
        fsdp=args.fsdp,
        sp=args.sp,
        remat=args.remat or remat_policy(cfg),
    )


def _fast_compiles() -> None:
    """The planner never runs the step: XLA's backend (LLVM) optimisation only costs compile time.
    Without it the buffer plan is the same (llama2-7b: identical temporaries) in about half the time."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_backend_optimization_level" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_backend_optimization_level=0".strip()


def run(args) -> int:
    model = _preset(args)
    if model is not None and args.mesh:  # what needs no devices is checked before them
        _settings(args, model[0]).check(model[0], *parse_mesh(args.mesh))
    if args.mesh and args.devices is None:  # nothing runs: as many fake devices as the mesh needs
        dp, mp = parse_mesh(args.mesh)
        args.devices = dp * mp
    _fast_compiles()
    mesh, _, _ = setup(args)
    from meshlm.perf.plan_report import format_plan
    from meshlm.perf.plan_search import plan

    if model is None:
        from meshlm.io.model_io import read_config

        model = (read_config(args.checkpoint)[0], f"checkpoint {args.checkpoint}")
    cfg, name = model
    report = plan(
        cfg,
        name,
        mesh,
        _settings(args, cfg),
        device_bytes=args.device_memory,
        max_compiles=args.max_compiles,
        every_option=args.every_option,
    )
    print(json.dumps(report) if args.json else format_plan(report))
    # The answer to "will it fit?" as the exit status, for scripts: 1 when the run does not fit
    # --device-memory and no option tried makes it fit (the report says so), else 0.
    row = report["plan"]
    return 1 if report["device_memory"] is not None and not row["fits"] and not report["recommended"] else 0
