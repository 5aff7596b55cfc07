"""Where a mixture of experts' train step spends what dense-eq's does not, read from the chip's compiler.

meshlm's bf16 train step of ``--config`` with each ``--dispatch``, and of its dense-eq
(``perf.bench_moe.dense_equivalent``, as ``meshlm bench`` builds it), compiled ahead of time by XLA:TPU
for a compile-only v5e (libtpu: ``pip install -e '.[tpu-plan]'``, no chip needed; ``perf.plan_target``).
From each optimized HLO module the script lists the top-level instructions (fusions, sorts,
custom calls; the branch of the optimizer's conditional that updates; a while loop's body once) with
their bytes (operands + results), FLOPs (dots and convolutions inside fusions; a Pallas kernel's own
``cost_estimate``) and a roofline time, max(bytes / 819 GB/s, FLOPs / 197 TFLOP/s), summed by kind
(sort, scatter, gather, grouped matmul, other matmuls, the rest), then each MoE step's largest
instructions.

    PYTHONPATH=src python scripts/moe_hlo.py --config qwen3-moe-100m --dispatch ragged_dot,gmm

The roofline is an estimate, not a timing: async copies overlap compute, tiny instructions cost a
fixed ~1 us each on the chip whatever their bytes (the counts are printed for that), and a scan's
body is counted once. What it finds well is an instruction whose FLOPs or bytes are far beyond the
routed work (docs/benchmarks.md, "Where the experts' time went").
"""

from __future__ import annotations

import argparse
import collections
import os
import re

BANDWIDTH, PEAK = 819e9, 197e12  # the v5e's HBM bytes/s and bf16 FLOP/s
SIZES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1, "f64": 8, "s64": 8}
SHAPE = re.compile(r"\b(" + "|".join(SIZES) + r")\[([\d,]*)\]")
PLUMBING = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "copy-done", "slice-done"}
PLUMBING |= {"after-all", "opt-barrier", "async-done"}


def compiled_text(config: str, dispatch: str, batch: int, seq: int) -> str:
    """The optimized HLO of meshlm's bf16 train step of ``config`` with ``dispatch`` ("dense-eq": its
    dense equivalent, as ``meshlm bench`` builds it) on one compile-only v5e."""
    import jax
    import jax.numpy as jnp

    from meshlm.model.config import get_config
    from meshlm.model.transformer import param_shapes
    from meshlm.parallel.compile_target import compiling_for
    from meshlm.parallel.layout import Layout
    from meshlm.parallel.placement import batch_sharding
    from meshlm.perf.bench_moe import dense_equivalent
    from meshlm.perf.plan_target import resolve
    from meshlm.sharding.rules import model_specs, shardings
    from meshlm.train.config import TrainConfig
    from meshlm.train.step import COMPUTE_DTYPES, abstract_opt_state, sharded_step, step_model

    target = resolve("v5e", "chip", 1)  # one line naming the fix where libtpu is absent
    model = get_config(config)
    model = dense_equivalent(model) if dispatch == "dense-eq" else model.replace(moe_dispatch=dispatch)
    cfg = step_model(model, remat="none", unroll=0, fsdp=False)  # as ``meshlm bench`` runs it
    layout = target.place(Layout(dp=1, mp=1))
    shapes = param_shapes(cfg)
    specs = model_specs(cfg, shapes, layout)
    sh = shardings(specs, layout.mesh)
    params = jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, jnp.float32, sharding=h), shapes, sh)
    rows = batch_sharding(layout, 1)
    tokens = {k: jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=rows) for k in ("inputs", "targets")}
    with compiling_for(target.platform):
        step, opt = sharded_step(
            cfg, TrainConfig().optim(), layout, specs, params, COMPUTE_DTYPES["bfloat16"]
        )
        state = abstract_opt_state(opt, params, specs, layout.mesh)
        return step.lower(params, state, tokens).compile().as_text()


def nbytes(shape: str) -> int:
    """The bytes of an HLO shape (a tuple's elements summed; layouts ignored)."""
    total = 0
    for dtype, dims in SHAPE.findall(re.sub(r"\{[^}]*\}", "", shape)):
        total += SIZES[dtype] * _prod(int(d) for d in dims.split(",") if d)
    return total


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def _dims(shape: str) -> list[int]:
    found = SHAPE.search(re.sub(r"\{[^}]*\}", "", shape))
    return [int(d) for d in found.group(2).split(",") if d] if found else []


def parse(text: str) -> tuple[dict, dict, str]:
    """({computation: [(name, shape, opcode, rest of line)]}, {name: shape}, the entry's name)."""
    comps, shapes, cur, entry = {}, {}, None, ""
    for line in text.splitlines():
        head = re.match(r"^(ENTRY )?%(\S+) .*\{\s*$", line)
        if head:
            cur = head.group(2)
            comps[cur] = []
            entry = cur if head.group(1) else entry
            continue
        inst = re.match(r"^\s*(?:ROOT )?%(\S+) = (.*?) ([a-z\-]+)\((.*)$", line)
        if inst and cur:
            shapes[inst.group(1)] = inst.group(2)
            comps[cur].append(inst.groups())
    return comps, shapes, entry


def flops(comps: dict, shapes: dict, comp: str) -> int:
    """The dot and convolution FLOPs of computation ``comp`` and the fusions it calls: 2 x the output's
    elements x the contraction (a convolution's input-feature dim, its window being the batch trick)."""
    total = 0
    for _, shape, op, rest in comps.get(comp, []):
        operands = re.findall(r"%([\w.\-]+)", rest.split(")")[0])
        if op == "convolution":
            labels = re.search(r"dim_labels=(\w+)_", rest).group(1)
            total += 2 * _prod(_dims(shape)) * _dims(shapes[operands[0]])[labels.index("f")]
        elif op == "dot":
            lhs = _dims(shapes[operands[0]])
            contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest).group(1)
            total += 2 * _prod(_dims(shape)) * _prod(lhs[int(i)] for i in contracting.split(",") if i)
        elif op == "fusion":
            total += flops(comps, shapes, re.search(r"calls=%([\w.\-]+)", rest).group(1))
    return total


def instructions(text: str) -> list[dict]:
    """The top-level instructions of a compiled step (module docstring), each {name, op, shape, bytes,
    flops, t (roofline seconds), src (JAX's op_name)}."""
    comps, shapes, entry = parse(text)
    rows = []

    def walk(comp):
        for name, shape, op, rest in comps[comp]:
            if op in PLUMBING:
                continue
            if op == "conditional":  # the optimizer's update: its last branch
                walk(
                    re.findall(r"%([\w.\-]+)", re.search(r"branch_computations=\{([^}]*)\}", rest).group(1))[
                        -1
                    ]
                )
                continue
            if op == "while":
                walk(re.search(r"body=%([\w.\-]+)", rest).group(1))
                continue
            rows.append(_row(comps, shapes, name, shape, op, rest))

    walk(entry)
    return rows


def _row(comps, shapes, name, shape, op, rest) -> dict:
    operands = re.findall(r"%([\w.\-]+)", rest.split("),")[0])
    size = nbytes(shape) + sum(nbytes(shapes.get(a, "")) for a in operands)
    if op in ("async-start", "copy-start", "slice-start"):  # moves its result, not the whole operand
        size = 2 * nbytes(re.split(r"\), ", shape, maxsplit=1)[-1])
    work = flops(comps, shapes, re.search(r"calls=%([\w.\-]+)", rest).group(1)) if op == "fusion" else 0
    estimate = re.search(r'"cost_estimate":\{"flops":"(\d+)"', rest)  # a Pallas kernel's own
    if estimate:
        work = int(estimate.group(1))
    elif "ragged-dot" in name and len(_dims(shape)) == 2:  # XLA's grouped kernel: [M, N] from [.., K, N]
        k = next((d[-2] for d in map(lambda a: _dims(shapes.get(a, "")), operands) if len(d) == 3), 0)
        work = 2 * _prod(_dims(shape)) * k
    src, calls = re.search(r'op_name="([^"]*)"', rest), re.search(r"calls=%([\w.\-]+)", rest)
    return dict(name=name, op=op, shape=re.sub(r"\{[^}]*\}", "", shape), bytes=size, flops=work,
                t=max(size / BANDWIDTH, work / PEAK), src=src.group(1) if src else "",
                calls=calls.group(1) if calls else "")  # fmt: skip


def kind(row: dict) -> str:
    """What an instruction is for, by its opcode and the JAX op that made it."""
    src, op, name = row["src"], row["op"], row["name"]
    if op == "sort":
        return "sort"
    for word in ("scatter", "gather"):
        if word in src:
            return f"{word} ({'backward' if 'transpose' in src else 'forward'})"
    if row["calls"].startswith("convolution_select_fusion"):  # XLA:TPU's ragged_dot weight gradient
        return "grouped matmul (masked dense)"
    if "ragged" in name or "ragged_dot" in src or "gmm" in src:
        return "grouped matmul"
    return "matmul" if row["flops"] else "elementwise, copies, the rest"


def summary(rows: list[dict]) -> dict:
    """{kind: [instructions, roofline seconds, bytes, FLOPs]}."""
    out = collections.defaultdict(lambda: [0, 0.0, 0, 0])
    for row in rows:
        entry = out[kind(row)]
        entry[0] += 1
        entry[1] += row["t"]
        entry[2] += row["bytes"]
        entry[3] += row["flops"]
    return dict(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="qwen3-moe-100m")
    p.add_argument("--dispatch", default="ragged_dot", help="comma-separated --moe-dispatch values")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--top", type=int, default=12, help="the MoE steps' N largest instructions")
    a = p.parse_args()
    os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"  # a cache hit has no HLO to read
    steps = ("dense-eq", *a.dispatch.split(","))
    texts = {d: compiled_text(a.config, d, a.batch_size, a.seq_len) for d in steps}
    print(f"{a.config}, batch {a.batch_size} x {a.seq_len}, bf16, XLA:TPU for a compile-only v5e")
    for step, text in texts.items():
        rows = instructions(text)
        total, loops = sum(r["t"] for r in rows), len(re.findall(r" while\(", text))
        print(
            f"\n{step}: {len(rows)} instructions, {loops} while loops (a body counted once), "
            f"roofline {total * 1e3:.2f} ms"
        )
        for k, (n, t, size, work) in sorted(summary(rows).items(), key=lambda kv: -kv[1][1]):
            print(f"  {k:<32}{n:>6}{t * 1e3:>10.3f} ms{size / 1e6:>10.1f} MB{work / 1e9:>10.1f} GFLOP")
        if step != "dense-eq":
            for r in sorted(rows, key=lambda r: -r["t"])[: a.top]:
                print(
                    f"    {r['t'] * 1e6:8.1f} us {r['flops'] / 1e9:7.1f} GF {r['shape'][:48]:<48} {kind(r)}"
                )


if __name__ == "__main__":
    main()
