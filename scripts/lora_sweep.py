"""The LoRA tolerance sweep (issue 66): ``verify``'s LoRA proof over rank x alpha x mesh x dtype x
adapters, each a correct model that must pass, and the wrong scale (alpha where alpha / R belongs)
detected with a margin wherever it is a different number (R != 1).

    python scripts/lora_sweep.py                       # the full sweep (hours on a loaded 2-core machine)
    python scripts/lora_sweep.py --ranks 1 4 --alphas 1 32 128 --meshes 1x2 --dtypes float64

Adapters: ``proof`` (verify's own draw, ``proof.lora.drawn_adapters``), ``fresh`` (training's start:
kaiming A, B = 0), ``trained`` (kaiming A, B at 0.02: a trained adapter's size), ``large`` (A and B at
0.5 N(0, 1), the draw verify used before: kappa ~ 50 at alpha 32, R 4). A row per case: ok, the
tolerance factor kappa, the worst adapter leaf's error, and the wrong scale's margin in tolerances.
Exit 1 if a correct model fails or the wrong scale is missed (margin < 100) on the proof's draw.
"""

from __future__ import annotations

import argparse
import os
import sys

MIN_MARGIN = 100.0  # tolerances by which the wrong scale must be detected on the proof's own draw


def _adapters(kind: str, cfg, params):
    """The adapters of ``kind`` over ``params``' base (global arrays)."""
    import jax
    import numpy as np

    from meshlm.model import lora
    from meshlm.proof.lora import drawn_adapters

    if kind == "proof":
        return drawn_adapters(cfg, params)
    rng = np.random.default_rng(7)

    def draw(name, x):
        fan_in = int(np.prod(x.shape[1:-1])) if name.endswith("_a") else 1
        if kind == "large":
            value = 0.5 * rng.standard_normal(x.shape)
        elif name.endswith("_a"):  # kaiming-uniform's size, as training starts
            value = rng.uniform(-1, 1, x.shape) / np.sqrt(fan_in)
        else:
            value = np.zeros(x.shape) if kind == "fresh" else 0.02 * rng.standard_normal(x.shape)
        return jax.device_put(value, x.sharding).astype(x.dtype)

    return {m: {n: draw(n, x) for n, x in leaves.items()} for m, leaves in lora.adapters(params).items()}


def one(rank: int, alpha: float, mesh: str, dtype: str, kind: str, steps: int) -> dict:
    import dataclasses

    import jax
    import jax.numpy as jnp

    from meshlm.model import lora
    from meshlm.model.config import get_config
    from meshlm.parallel.layout import Layout
    from meshlm.proof import model_problem, verify
    from meshlm.proof.lora import LORA_CONTROLS, lora_problem

    dp, mp = map(int, mesh.split("x"))
    lay = Layout(dp=dp, mp=mp)
    cfg = get_config("tiny-llama").replace(lora_rank=rank, lora_alpha=float(alpha), lora_targets="q,k,v,o,up")
    problem = lora_problem(model_problem(cfg, "tiny-llama", lay, 2 * dp, 32))
    if kind != "proof":  # a model's own adapters, as ``verify --checkpoint`` proves them
        prepare = problem.prepare_params
        problem = dataclasses.replace(
            problem,
            prepare_params=lambda p: lora.combine(lora.base(p), _adapters(kind, cfg, prepare(p))),
        )
    controls = tuple(c for c in LORA_CONTROLS if c.name == "LoRA scale alpha, not alpha/R")
    with jax.enable_x64(dtype == "float64"):
        report = verify(problem, lay, dtype=jnp.dtype(dtype), steps=steps, controls=controls)
    adapters = [p.max_rel_err for p in report.params if lora.is_adapter(p.path)]
    wrong = [c for c in report.controls if c["name"] == "LoRA scale alpha, not alpha/R"]
    failed = [p.path for p in report.params if not p.ok] + [c["name"] for c in report.checks if not c["ok"]]
    return {
        "rank": rank,
        "alpha": alpha,
        "mesh": mesh,
        "dtype": dtype,
        "adapters": kind,
        "values_ok": not failed and report.loss_ok,
        "failed": failed,
        "factor": report.extra.get("lora_tolerance_factor", 1.0),
        "worst_rel": max(adapters),
        "wrong_scale_margin": (wrong[0].get("margin") if wrong[0]["detected"] else 0.0) if wrong else None,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])  # 64: above wk's 32
    ap.add_argument("--alphas", type=float, nargs="+", default=[1, 2, 8, 16, 32, 64, 128])
    ap.add_argument("--meshes", nargs="+", default=["1x2", "2x1", "2x2"])
    ap.add_argument("--dtypes", nargs="+", default=["float64", "float32"])
    ap.add_argument("--adapters", nargs="+", default=["proof", "fresh", "trained", "large"])
    ap.add_argument("--steps", type=int, default=0)
    args = ap.parse_args(argv)
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    from meshlm.errors import ConfigError

    bad = 0
    for rank in args.ranks:
        for alpha in [*args.alphas, float(rank)] if float(rank) not in args.alphas else args.alphas:
            for mesh in args.meshes:
                for dtype in args.dtypes:
                    for kind in args.adapters:
                        try:
                            row = one(rank, alpha, mesh, dtype, kind, args.steps)
                        except ConfigError as e:  # a rank above tiny-llama's target widths
                            print(f"r={rank} alpha={alpha:g}: refused ({e})", flush=True)
                            break
                        margin = row["wrong_scale_margin"]
                        missed = kind == "proof" and rank != 1 and (margin is None or margin < MIN_MARGIN)
                        bad += (not row["values_ok"]) + missed
                        print(
                            f"r={rank:<3} alpha={alpha:<5g} {mesh} {dtype} {kind:<8} "
                            f"{'ok' if row['values_ok'] else 'FAIL ' + str(row['failed'])} "
                            f"kappa={row['factor']:.3g} worst={row['worst_rel']:.2e} "
                            f"wrong-scale margin={margin if margin is None else f'{margin:.2g}'}"
                            + (" MISSED" if missed else ""),
                            flush=True,
                        )
    print(f"{bad} failures", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
