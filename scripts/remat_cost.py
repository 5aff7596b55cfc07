"""XLA:TPU's own cost model of qwen3-0.6b's train step under each remat policy, from a compile-only v5e.

Each case compiles a shortened copy of the preset (``--layers`` L and 2L layers: same d_model, heads, d_ff
and the whole 151,936-id vocabulary; seq 2048, bf16 compute, AdamW, ``--loss-chunk 512``, flash
attention, mesh 1x1) for a compile-only chip (libtpu: ``perf.plan_target``; no chip is needed), reads the
``estimated_cycles`` XLA:TPU writes on every instruction after code generation, and scales to the
preset's layers: a layer = (step(2L) - step(L)) / L, the rest (embedding, head, loss, the update of the
non-layer weights) = step(L) - L x layer. It prints one JSON line a case: the predicted step (ms), ms a
token, the MFU at the v5e's spec 197 TFLOP/s (model FLOPs 6N + 12LTD a token), and a layer's
milliseconds by kind (matmul fusions, the flash kernels, other fusions, copies, reduce-precision, ...).

    PYTHONPATH=src python scripts/remat_cost.py --cases b8/full b8/save_qkv_proj b4/selective/bf16

``--unroll -1``: the layers as straight-line code (no loop: no stacked residuals); ``--loss-chunk N``:
the head's loss in chunks of N rows (512 as the chip report runs it); ``--ops N``: also a layer's N
costliest JAX operations, each "kind phase path" (phase: fwd, re the recomputed forward, bwd). The
kernels (flash attention's Mosaic ``tpu_custom_call``) carry no estimate and are left out: compare a
prediction with the chip's time.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
SEQ_LEN, LOSS_CHUNK, CLOCK, SPEC = 2048, 512, 1.5e9, 197e12


# XLA:TPU's dump after code generation, parsed as scripts/int8_hlo.py does (its module: one parser)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from int8_hlo import computations, costed  # noqa: E402


def compile_dump(
    config: str,
    layers: int,
    batch: int,
    remat: str,
    opt_dtype: str,
    chip: str,
    unroll: int = 0,
    loss_chunk: int = LOSS_CHUNK,
) -> tuple[str, int]:
    """(the after-codegen HLO text, the compiler's peak bytes) of the step of ``config`` cut to
    ``layers`` layers."""
    from meshlm.model.config import get_config
    from meshlm.parallel.compile_target import compiling_for
    from meshlm.parallel.layout import Layout
    from meshlm.perf.plan import abstract_step
    from meshlm.perf.plan_settings import PlanSettings
    from meshlm.perf.plan_target import resolve

    target = resolve(chip, "chip", 1)
    cfg = get_config(config).replace(
        n_layers=layers,
        attention="flash",
        loss_chunk=loss_chunk,
        unroll=layers if unroll < 0 else unroll,
    )
    settings = PlanSettings(
        batch_size=batch, seq_len=SEQ_LEN, compute_dtype="bfloat16", remat=remat, opt_dtype=opt_dtype
    )
    dump = tempfile.mkdtemp(prefix="remat_cost_")
    with compiling_for(target.platform):
        step, *args = abstract_step(cfg, target.place(Layout(dp=1, mp=1)), settings)
        compiled = step.lower(*args).compile({"xla_dump_to": dump})
    peak = compiled.memory_analysis().peak_memory_in_bytes
    (path,) = glob.glob(os.path.join(dump, "*jit_step*after_codegen.txt"))
    print(f"dump {layers} layers: {path}", file=sys.stderr)
    return open(path).read(), peak


def kind(op: str, line: str, matmul: bool) -> str:
    """The kind of one costed instruction: matmul fusion, the flash kernel (a custom call), ..."""
    if op == "custom-call":
        return "kernel"
    if matmul:
        return "matmul"
    if op == "fusion":
        if "reduce-precision" in line or "reduce_precision" in line:
            return "fusion(reduce_precision)"
        return "fusion"
    return op


def cycles_by_kind(hlo: str) -> tuple[dict[str, float], dict[str, float]]:
    """(ms by kind, ms by ``kind phase operation``) of XLA:TPU's estimated cycles over the step (loops
    per trip)."""
    comps, entry = computations(hlo)
    out, ops = {}, {}
    for cycles, op, line, matmul, name in costed(comps, entry, 1):
        k, ms = kind(op, line, matmul), cycles / CLOCK * 1e3
        out[k] = out.get(k, 0.0) + ms
        ops[f"{k} {operation(name)}"] = ops.get(f"{k} {operation(name)}", 0.0) + ms
    return out, ops


def operation(name: str) -> str:
    """A JAX op name as "phase module/op": the phase "fwd" (the forward), "re" (full remat's recomputed
    forward) or "bwd" (the backward), then the path inside the layer ("attn/q_norm/reduce_sum")."""
    phase = "re" if "rematted_computation" in name else "bwd" if "transpose(" in name else "fwd"
    inner = re.sub(r".*(closed_call|checkpoint|rematted_computation)/", "", name.replace("jit(step)/", ""))
    return f"{phase} {re.sub(r'(jvp|transpose)[(][^/]*[)]+/', '', inner)}"


def run_case(
    case: str,
    config: str,
    layers: int,
    chip: str,
    unroll: int = 0,
    loss_chunk: int = LOSS_CHUNK,
    ops: int = 0,
) -> dict:
    parts = case.split("/")
    batch, remat, opt = int(parts[0][1:]), parts[1], parts[2] if len(parts) > 2 else "float32"
    from meshlm.model.config import get_config

    full = get_config(config)
    (h1, p1), (h2, p2) = (
        compile_dump(config, n, batch, remat, opt, chip, unroll, loss_chunk) for n in (layers, 2 * layers)
    )
    (k1, o1), (k2, o2) = cycles_by_kind(h1), cycles_by_kind(h2)
    layer = {k: (k2.get(k, 0) - k1.get(k, 0)) / layers for k in set(k1) | set(k2)}
    by_op = {k: (o2.get(k, 0) - o1.get(k, 0)) / layers for k in set(o1) | set(o2)}
    rest = {k: k1.get(k, 0) - layers * layer[k] for k in layer}
    step = sum(rest.values()) + full.n_layers * sum(layer.values())
    tokens = batch * SEQ_LEN
    flops = model_flops(full) * tokens
    return {
        "case": case,
        "step_ms": round(step, 1),
        "us_per_token": round(step / tokens * 1e3, 3),
        "mfu": round(flops / (step / 1e3) / SPEC, 3),
        # the compiler's peak (its heap) scaled to the preset's layers as the time is
        "peak_gib": round((p1 + (full.n_layers - layers) * (p2 - p1) / layers) / 2**30, 2),
        "layer_ms": {k: round(v, 3) for k, v in sorted(layer.items(), key=lambda p: -p[1])},
        "rest_ms": {k: round(v, 2) for k, v in sorted(rest.items(), key=lambda p: -p[1])},
        # a layer's ms by JAX operation, the ``ops`` largest (``--ops``)
        "layer_ops": {k: round(v, 3) for k, v in sorted(by_op.items(), key=lambda p: -abs(p[1]))[:ops]},
    }


def model_flops(cfg) -> float:
    """6N + 12 L T D a token (N: every parameter, the embedding too; T: the sequence)."""
    import math

    import jax

    from meshlm.model.transformer import param_shapes

    n = sum(math.prod(s.shape) for s in jax.tree.leaves(param_shapes(cfg)))
    return 6 * n + 12 * cfg.n_layers * SEQ_LEN * cfg.d_model


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="qwen3-0.6b")
    p.add_argument("--layers", type=int, default=2, help="the short copy's layers (and twice that)")
    p.add_argument("--chip", default="v5e")
    p.add_argument(
        "--unroll",
        type=int,
        default=0,
        help="layers an iteration of the loop (0: as train runs; -1: every layer, no loop)",
    )
    p.add_argument("--cases", nargs="+", default=["b8/full"], help="bBATCH/REMAT[/OPT_DTYPE]")
    p.add_argument(
        "--loss-chunk", type=int, default=LOSS_CHUNK, help="the head's loss in chunks of this many"
    )
    p.add_argument("--ops", type=int, default=0, help="also a layer's ms by JAX operation, the N largest")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        print(
            json.dumps(run_case(a.cases[0], a.config, a.layers, a.chip, a.unroll, a.loss_chunk, a.ops)),
            flush=True,
        )
        return 0
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(SRC), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
        ),
    }
    for case in a.cases:
        argv = [
            sys.executable,
            __file__,
            "--one",
            "--cases",
            case,
            "--config",
            a.config,
            "--layers",
            str(a.layers),
            "--chip",
            a.chip,
            "--unroll",
            str(a.unroll),
            "--loss-chunk",
            str(a.loss_chunk),
            "--ops",
            str(a.ops),
        ]
        done = subprocess.run(argv, env=env, stdout=subprocess.PIPE, text=True)
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
        print(lines[-1] if lines else json.dumps({"case": case, "failed": done.returncode}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
