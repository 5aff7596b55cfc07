"""Where the int8 step's time goes: XLA's optimized HLO of the bf16 and the ``--quant int8`` train step,
read two ways (issue 65 item 3).

Both steps are compiled as ``meshlm bench --impls meshlm,meshlm-int8 --bf16`` builds them (one device,
bench's --attention auto for the platform, --remat and --loss-chunk as given; ``--chip v5e``: the
chip's own compiler, XLA:TPU, on a compile-only device, so no chip is needed: ``perf.plan_target``),
and XLA dumps each. Then:

* a roofline of the optimized program: every top-level instruction (a fusion, a convolution, a copy,
  an async copy between main and on-chip memory) costed as

      time = max(matmul FLOPs / peak, main-memory bytes read and written / bandwidth)

  with the peak of its matmul's operands (int8: ``--int8-tops``, else ``--bf16-tflops``: the v5e's
  measured 376 TOP/s and 180 TFLOP/s) and the bytes of its operands and result in main memory (HLO
  shapes; data in on-chip memory, a layout's ``S(1)``, is free; an operand read in part counts
  whole). With it: the s8 matmuls, the int32 arrays written to memory (an accumulator whose rescale
  XLA did not fuse into the matmul), the ``--top`` costliest instructions that are not matmuls;
* XLA:TPU's own cost model (``--chip`` only): the estimated cycles it records on each instruction
  after code generation, which count the vector unit's work the roofline leaves out, per step and by
  JAX operation, the ``--top`` that differ most between the two steps.

    PYTHONPATH=src python scripts/int8_hlo.py --chip v5e --config llama-100m --batch-size 8 --seq-len 512
    PYTHONPATH=src python scripts/int8_hlo.py --chip v5e --matmul 4096,768,3072

``--matmul N,K,M``: one weight matmul's forward and backward alone (x [N, K] @ w [K, M]), bf16 and
int8: a change to ``model.quant`` tried in two minutes rather than a whole step's ten.

Without ``--chip``: this host's compiler (its HLO is not the chip's; the script's test). Measured
figures and what they showed: docs/quantization.md, "Speed".
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import re
import tempfile
from dataclasses import dataclass

BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4}
BYTES |= {"s64": 8, "u64": 8, "f64": 8, "c64": 8}
SHAPE = re.compile(r"\b(pred|[suf]\d+|bf16|c64)\[([\d,]*)\](\{[^}]*\})?")
FREE = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "after-all", "partition-id"}
FREE |= {"replica-id", "opt-barrier", "iota"}


@dataclass(frozen=True)
class Cost:
    """One top-level instruction of the step: its name, opcode, bytes moved, matmul FLOPs (int8 ones
    apart), and the types of its matmuls' operands and results ("s8xs8->s32" ...)."""

    name: str
    op: str
    bytes: int
    flops: float
    int8_flops: float
    matmuls: tuple[str, ...]
    shape: str

    def seconds(self, bf16_peak: float, int8_peak: float, bandwidth: float) -> float:
        return max(self.flops / bf16_peak + self.int8_flops / int8_peak, self.bytes / bandwidth)


def shape_bytes(text: str, hbm: bool = False) -> int:
    """The bytes of every array shape in ``text`` (a shape or a tuple of them), tiling padding left out;
    ``hbm``: only those in main memory (not XLA:TPU's on-chip memory space, a layout's ``S(1)``)."""
    arrays = SHAPE.findall(text)
    return sum(
        BYTES[t] * math.prod(int(d) for d in dims.split(",") if d)
        for t, dims, layout in arrays
        if not (hbm and "S(1)" in layout)
    )


def computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    """({computation name: its instruction lines}, the entry computation's name) of an HLO module's text."""
    comps, entry, name = {}, None, None
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if head and not line.startswith(" "):
            name = head.group(2)
            comps[name] = []
            entry = name if head.group(1) else entry
        elif name and line.startswith("  ") and "=" in line:
            comps[name].append(line.strip())
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry


def _parts(line: str) -> tuple[str, str, str, str]:
    """(name, result shape, opcode, the rest) of one instruction line."""
    found = re.match(r"(?:ROOT )?%?([\w.\-]+) = (\(.*?\)|\S+) ([\w\-]+)\((.*)$", line)
    if found is None:
        return "", "", "", ""
    return found.groups()


def matmul_flops(line: str, shapes: dict[str, str]) -> tuple[float, str]:
    """(FLOPs, "lhs x rhs -> result" types) of a dot or convolution line (0 for anything else)."""
    name, shape, op, rest = _parts(line)
    if op not in ("dot", "convolution"):
        return 0.0, ""
    operands = re.findall(r"%([\w.\-]+)", rest.split(")")[0])[:2]
    lhs = shapes.get(operands[0], "") if operands else ""
    rhs = shapes.get(operands[1], "") if len(operands) > 1 else ""
    (lt, ldims, _), (rt, _, _) = SHAPE.findall(lhs)[0], SHAPE.findall(rhs)[0]
    out = math.prod(int(d) for d in SHAPE.findall(shape)[0][1].split(",") if d)
    dims = [int(d) for d in ldims.split(",") if d]
    if op == "dot":
        contract = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest).group(1)
        k = math.prod(dims[int(i)] for i in contract.split(",") if i)
    else:  # dim_labels=LHS_RHS->OUT: the lhs's input feature dim 'f', times the window's dims that are
        # contractions; XLA:TPU writes a dot's batch dims as padded or dilated window dims (one
        # position of the window meets the data): those add no terms
        labels = re.search(r"dim_labels=([\w]+)_", rest).group(1)
        k = math.prod(d for d, c in zip(dims, labels, strict=True) if c == "f")
        k *= math.prod(_window_terms(rest))
    return 2.0 * out * k, f"{lt}x{rt}->{SHAPE.findall(shape)[0][0]}"


def _window_terms(rest: str) -> list[int]:
    """The window sizes of a convolution's dims that sum terms: neither padded nor lhs-dilated."""
    window = re.search(r"window=\{([^}]*)\}", rest)
    if window is None:
        return []
    fields = dict(re.findall(r"(\w+)=(\S+)", window.group(1)))
    sizes = [int(v) for v in fields["size"].split("x")]
    pads = fields.get("pad", "x".join(["0_0"] * len(sizes))).split("x")
    dilate = [int(v) for v in fields.get("lhs_dilate", "x".join(["1"] * len(sizes))).split("x")]
    return [n for n, p, d in zip(sizes, pads, dilate, strict=True) if p == "0_0" and d == 1]


def trip_count(comps, rest: str) -> int:
    """A while loop's trips: its known trip count, else its condition's ``i < N`` bound (JAX's loops
    count from 0), else 1."""
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
    if known:
        return int(known.group(1))
    cond = re.search(r"condition=%?([\w.\-]+)", rest)
    lines = comps.get(cond.group(1), []) if cond else []
    bounds = [re.search(r"s32\[\]\S* constant\((\d+)\)", x) for x in lines]
    bounds = [int(b.group(1)) for b in bounds if b]
    return bounds[0] if len(bounds) == 1 and any("direction=LT" in x for x in lines) else 1


def step_costs(hlo: str) -> list[Cost]:
    """Every top-level instruction of the entry computation with its main-memory bytes and matmul FLOPs:
    a while loop's body once per known trip, a conditional's costliest branch (the step's update runs
    behind an is-finite test), an async copy or slice once (at its start: what it reads from and writes
    to main memory; its data in on-chip memory, ``S(1)``, is free)."""
    comps, entry = computations(hlo)
    return _costs(comps, entry, 1)


def _costs(comps, name, times) -> list[Cost]:
    shapes, out = {}, []
    for line in comps[name]:
        n, shape, op, rest = _parts(line)
        shapes[n] = shape
        if op in FREE or not op or op.endswith("-done"):
            continue
        if op == "while":
            body = re.search(r"body=%?([\w.\-]+)", rest).group(1)
            out += _costs(comps, body, times * trip_count(comps, rest))
            continue
        if op == "conditional":
            branches = re.search(r"branch_computations=\{([^}]*)\}", rest)
            names = re.findall(r"%?([\w.\-]+)", branches.group(1)) if branches else []
            names += [m for m in re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", rest)]
            costed = [_costs(comps, b, times) for b in names if b in comps]
            out += max(costed, key=lambda cs: sum(c.bytes for c in cs), default=[])
            continue
        operands = re.findall(r"%([\w.\-]+)", rest.split("), ")[0])
        if op.endswith("-start"):  # (operand alias, destination, context): a DMA of the destination's
            # bytes (a slice reads that much of its operand) between main and on-chip memory
            t, d, lay = SHAPE.findall(shape)[1]
            moved = shape_bytes(f"{t}[{d}]")
        else:
            moved = shape_bytes(shape, hbm=True) + sum(
                shape_bytes(shapes.get(o, ""), hbm=True) for o in operands
            )
        inner = [line]
        called = re.search(r"calls=%?([\w.\-]+)", rest)
        if called and called.group(1) in comps:
            inner = comps[called.group(1)]
        inner_shapes = {_parts(x)[0]: _parts(x)[1] for x in inner} | shapes
        flops = [matmul_flops(x, inner_shapes) for x in inner]
        int8 = sum(f for f, kind in flops if kind.startswith("s8"))
        plain = sum(f for f, kind in flops if kind and not kind.startswith("s8"))
        kinds = tuple(kind for _, kind in flops if kind)
        out += [Cost(n, op, moved, plain, int8, kinds, shape.split("{")[0])] * times
    return out


def xla_cycles(hlo: str) -> list[tuple[int, str, bool]]:
    """XLA:TPU's own cost model of a step: (estimated cycles, JAX op name, holds a matmul) of every
    instruction of the entry computation that carries one (the ``estimated_cycles`` of its backend
    config, in the dump after code generation), a while loop's body once per known trip, a
    conditional's costliest branch. On the v5e it predicted the bf16 llama-100m step within 3% of the
    chip's time (docs/quantization.md, "Speed")."""
    comps, entry = computations(hlo)
    return [(cycles, source, matmul) for cycles, _, _, matmul, source in costed(comps, entry, 1)]


def costed(comps, name, times) -> list[tuple[int, str, str, bool, str]]:
    """(cycles, opcode, its line with its callees', holds a matmul, JAX op name) of every instruction
    of computation ``name`` that carries ``estimated_cycles``, ``times`` over: a while loop's body once
    per trip, a conditional's costliest branch (scripts/remat_cost.py sorts these by kind)."""
    out = []
    for line in comps[name]:
        _, _, op, rest = _parts(line)
        if op == "while":
            body = re.search(r"body=%?([\w.\-]+)", rest).group(1)
            out += costed(comps, body, times * trip_count(comps, rest))
        elif op == "conditional":
            found = re.search(r"branch_computations=\{([^}]*)\}", rest)
            names = [n for n in re.findall(r"%?([\w.\-]+)", found.group(1) if found else "") if n in comps]
            branches = [costed(comps, b, times) for b in names]
            out += max(branches, key=lambda b: sum(c[0] for c in b), default=[])
        elif found := re.search(r'"estimated_cycles":"(\d+)"', rest):
            called = re.search(r"calls=%?([\w.\-]+)", rest)
            inner = list(_flat(comps, comps.get(called.group(1), []))) if called else []
            matmul = any(o in ("convolution", "dot") for o in (op, *(_parts(x)[2] for x in inner)))
            source = re.search(r'op_name="([^"]*)"', line)
            text = line + "\n" + "\n".join(inner)
            out += [(int(found.group(1)), op, text, matmul, source.group(1) if source else "")] * times
    return out


def _flat(comps, lines, depth=0):
    """``lines`` and the lines of the computations they call (fusions within fusions), 3 deep."""
    for line in lines:
        yield line
        called = re.search(r"calls=%?([\w.\-]+)", line)
        if called and called.group(1) in comps and depth < 3:
            yield from _flat(comps, comps[called.group(1)], depth + 1)


def compile_steps(
    config: str, batch: int, seq: int, chip: str | None, dump: str, remat: str = "none", loss_chunk: int = 0
) -> dict[str, object]:
    """{"bf16": compiled step, "int8": compiled step}: meshlm's bf16 step and its ``--quant int8`` one,
    as ``meshlm bench --impls meshlm,meshlm-int8 --bf16`` compiles them, each dumped into dump/NAME."""
    import jax
    import jax.numpy as jnp

    from meshlm.model.config import get_config
    from meshlm.model.transformer import param_shapes
    from meshlm.parallel.compile_target import compiling_for
    from meshlm.parallel.layout import Layout
    from meshlm.parallel.placement import batch_sharding
    from meshlm.perf.plan_target import resolve
    from meshlm.settings import LongContext
    from meshlm.sharding.rules import model_specs, shardings
    from meshlm.train.config import TrainConfig
    from meshlm.train.step import COMPUTE_DTYPES, abstract_opt_state, sharded_step, step_model

    target = resolve(chip, "chip" if chip else "auto", 1)
    attention = LongContext().attention_kind(target.platform, seq)  # bench's --attention auto
    base = get_config(config).replace(attention=attention, loss_chunk=loss_chunk)
    base = step_model(base, remat=remat, unroll=0, fsdp=False)  # bench's --remat, --unroll 0
    layout = target.place(Layout(dp=1, mp=1))
    shapes = param_shapes(base)
    specs = model_specs(base, shapes, layout)
    sh = shardings(specs, layout.mesh)
    params = jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, jnp.float32, sharding=h), shapes, sh)
    rows = batch_sharding(layout, 1)
    tokens = {k: jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=rows) for k in ("inputs", "targets")}
    out = {}
    with compiling_for(target.platform):
        for name, quant in (("bf16", "none"), ("int8", "int8")):
            cfg = base.replace(quant=quant)
            step, opt = sharded_step(
                cfg, TrainConfig().optim(), layout, specs, params, compute_dtype=COMPUTE_DTYPES["bfloat16"]
            )
            state = abstract_opt_state(opt, params, specs, layout.mesh)
            options = {"xla_dump_to": os.path.join(dump, name)}
            out[name] = step.lower(params, state, tokens).compile(options)
    return out


def matmul_steps(n: int, k: int, m: int, chip: str | None) -> dict[str, str]:
    """{"bf16": HLO text, "int8": HLO text} of one weight matmul's forward and backward, x [n, k] bf16 @
    w [k, m] (float32 master, cast to bf16), as ``dense`` and as ``int8_dense`` (column-parallel, one
    device), compiled for ``chip``: minutes less than a whole step, to try a change of ``model.quant``."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from meshlm.model import quant
    from meshlm.parallel.compile_target import compiling_for
    from meshlm.parallel.context import Parallel
    from meshlm.perf.plan_target import resolve

    target = resolve(chip, "chip" if chip else "auto", 1)
    one = SingleDeviceSharding(target.devices[0] if target.devices else jax.devices()[0])
    args = (jax.ShapeDtypeStruct((n, k), jnp.bfloat16, sharding=one),)
    args += (jax.ShapeDtypeStruct((k, m), jnp.float32, sharding=one),)

    def loss(x, w, int8):
        w = w.astype(jnp.bfloat16)
        y = quant.int8_dense(Parallel(), "col", x, w) if int8 else x @ w
        return jnp.sum(y.astype(jnp.float32) ** 2)  # a cotangent that depends on y, as a model's

    out = {}
    with compiling_for(target.platform):
        for name in ("bf16", "int8"):
            step = jax.jit(jax.grad(lambda x, w, q=name == "int8": loss(x, w, q), argnums=(0, 1)))
            out[name] = step.lower(*args).compile().as_text()
    return out


def dumped(folder: str, stage: str = "after_optimizations") -> str:
    """The train step's HLO text from XLA's dump in ``folder``: after optimizations (the program), or
    ``stage`` "after_codegen" (XLA:TPU's: each instruction's backend config with its estimated cycles)."""
    (path,) = glob.glob(os.path.join(folder, f"*jit_step*{stage}.txt"))
    return open(path).read()


def report(costs: dict[str, list[Cost]], peaks: tuple[float, float, float], top: int) -> list[str]:
    """The roofline's lines: per step its estimate and parts, the s8 matmuls, the int32 buffers written,
    the ``top`` costliest non-matmul instructions; then the int8 / bf16 ratio of the estimates."""
    lines, total = [], {}
    for name, cs in costs.items():
        secs = [c.seconds(*peaks) for c in cs]
        total[name] = sum(secs)
        mm = sum(s for c, s in zip(cs, secs, strict=True) if c.matmuls)
        rest = [(c, s) for c, s in zip(cs, secs, strict=True) if not c.matmuls]
        s8 = [k for c in cs for k in c.matmuls if k.startswith("s8")]
        s32 = [c for c in cs if c.shape.startswith("s32[") and shape_bytes(c.shape) > 2**16]
        flops, int8 = sum(c.flops for c in cs) / 1e12, sum(c.int8_flops for c in cs) / 1e12
        lines.append(
            f"{name}: roofline {total[name] * 1e3:.2f} ms = matmul fusions {mm * 1e3:.2f} ms + "
            f"{len(rest)} others {sum(s for _, s in rest) * 1e3:.2f} ms; "
            f"{sum(c.bytes for c in cs) / 1e9:.2f} GB moved, {flops:.3f} TFLOP float + {int8:.3f} TOP int8"
        )
        lines.append(f"  s8 matmuls: {len(s8)} {dict(sorted({k: s8.count(k) for k in s8}.items()))}")
        lines.append(
            f"  int32 arrays written to memory (> 64 KiB): {len(s32)}, "
            f"{sum(shape_bytes(c.shape) for c in s32) / 1e6:.1f} MB"
        )
        for c, s in sorted(rest, key=lambda p: -p[1])[:top]:
            lines.append(f"  {s * 1e6:8.1f} us {c.bytes / 1e6:8.1f} MB  {c.op:<12} {c.name} {c.shape}")
    if {"bf16", "int8"} <= set(total):
        lines.append(f"roofline int8 / bf16 step: {total['int8'] / total['bf16']:.3f}")
    return lines


def cycles_report(cycles: dict[str, list[tuple[int, str, bool]]], clock: float, top: int) -> list[str]:
    """XLA:TPU's cost model's lines: per step its total at ``clock`` Hz, matmul fusions and the rest, and
    the ``top`` JAX operations whose time differs most between the steps."""
    lines, by_op = [], {}
    for name, cy in cycles.items():
        total, mm = sum(c for c, _, _ in cy) / clock, sum(c for c, _, m in cy if m) / clock
        lines.append(
            f"{name}: XLA's cost model {total * 1e3:.2f} ms = matmul fusions {mm * 1e3:.2f} ms + "
            f"{sum(not m for _, _, m in cy)} others {(total - mm) * 1e3:.2f} ms"
        )
        ops = by_op[name] = {}
        for c, op, _ in cy:
            key = re.sub(r"jit\(step\)/|closed_call/|stack_frame.*", "", op)
            ops[key] = ops.get(key, 0.0) + c / clock
    if len(by_op) == 2:
        (a, oa), (b, ob) = by_op.items()
        diff = sorted(set(oa) | set(ob), key=lambda k: -abs(ob.get(k, 0) - oa.get(k, 0)))
        lines.append(f"  the {top} operations whose time differs most, {a} -> {b} (ms):")
        for k in diff[:top]:
            lines.append(f"  {oa.get(k, 0) * 1e3:8.2f} -> {ob.get(k, 0) * 1e3:8.2f}  {k or '(no op name)'}")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="llama-100m")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--remat", default="none", help="bench's --remat")
    p.add_argument("--loss-chunk", type=int, default=0, help="bench's --loss-chunk")
    p.add_argument("--chip", default=None, help="compile for a compile-only device of this chip (v5e)")
    p.add_argument("--dump", default=None, help="a folder for XLA's dumps (default: a new temporary one)")
    p.add_argument(
        "--top", type=int, default=10, help="print each step's N costliest non-matmul instructions"
    )
    p.add_argument("--bf16-tflops", type=float, default=180.0, help="the float matmul peak (v5e measured)")
    p.add_argument("--int8-tops", type=float, default=376.0, help="the int8 matmul peak (v5e measured)")
    p.add_argument("--clock-ghz", type=float, default=1.5, help="the chip's clock (v5e: 1.5 GHz)")
    p.add_argument("--hbm-gbs", type=float, default=819.0, help="memory bandwidth, GB/s (v5e spec)")
    p.add_argument("--matmul", default=None, help="N,K,M: one weight matmul's forward and backward only")
    a = p.parse_args()
    peaks = (a.bf16_tflops * 1e12, a.int8_tops * 1e12, a.hbm_gbs * 1e9)
    if a.matmul:
        n, k, m = (int(v) for v in a.matmul.split(","))
        texts = matmul_steps(n, k, m, a.chip)
        print(f"one matmul [{n}, {k}] @ [{k}, {m}], forward and backward, chip {a.chip or 'none (host)'}")
        print("\n".join(report({name: step_costs(t) for name, t in texts.items()}, peaks, a.top)))
        if a.chip:
            cycles = {name: xla_cycles(t) for name, t in texts.items()}
            print("\n".join(cycles_report(cycles, a.clock_ghz * 1e9, a.top)))
        return
    dump = a.dump or tempfile.mkdtemp(prefix="int8_hlo_")
    os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"  # a cache hit compiles (and dumps) nothing
    compiled = compile_steps(a.config, a.batch_size, a.seq_len, a.chip, dump, a.remat, a.loss_chunk)
    costs = {name: step_costs(dumped(os.path.join(dump, name))) for name in compiled}
    print(f"{a.config}, batch {a.batch_size} x {a.seq_len}, bf16 compute, chip {a.chip or 'none (host)'}")
    for name, c in compiled.items():
        ca = c.cost_analysis()
        ca = ca[0] if isinstance(ca, list) else ca
        print(
            f"{name}: XLA's cost analysis: {ca.get('flops', 0) / 1e12:.3f} TFLOP, "
            f"{ca.get('bytes accessed', 0) / 1e9:.2f} GB accessed"
        )
    print("\n".join(report(costs, peaks, a.top)))
    if a.chip:  # XLA:TPU's dump after code generation: its cost model's cycles
        cycles = {name: xla_cycles(dumped(os.path.join(dump, name), "after_codegen")) for name in compiled}
        print("\n".join(cycles_report(cycles, a.clock_ghz * 1e9, a.top)))


if __name__ == "__main__":
    main()
