"""One device's compiled memory of a train step: meshlm's ``sharded_step`` next to plain JAX's ``plain_step``.

Both steps are compiled ahead of time from ShapeDtypeStructs (nothing of the model is allocated) on the
default backend's first device (a TPU chip where there is one, else host CPU), with the same model,
batch, AdamW settings and compute dtype, and the script prints XLA's ``memory_analysis()`` of each:
argument, output, alias (outputs written into donated inputs), temporaries and the peak (argument +
output + temp - alias, as ``meshlm bench`` and ``meshlm plan`` count it), and meshlm's over plain's.

    PYTHONPATH=src python scripts/step_memory.py --config llama-100m --batch-size 8 --seq-len 512
    PYTHONPATH=src python scripts/step_memory.py --config llama-100m --batch-size 8 --seq-len 512 --chip v5e

``--chip v5e``: both steps compiled by the chip's own compiler, XLA:TPU, for a compile-only v5e device
(libtpu installed: ``pip install -e '.[tpu-plan]'``; no chip is needed, ``perf.plan_target``), so the
figures are the chip's from any host. ``--attention`` is meshlm's (plain JAX's is always the [B, H, T, T]
scores); plain by default, as docs/benchmarks.md's float32 comparison runs it. ``--top N``: each step's
N largest temporaries live at its peak (XLA's live-range report of the compiled step: the instruction, its
shape and the JAX operation that made it) and the N largest slots of its memory heap (a slot's
buffers live at different times; the heap, what the chip holds, is the slots side by side: a step can
hold less at its live peak than another and still need the larger heap), to find the buffers that
differ; ``--dump DIR``: XLA's
whole dump of both compilations (HLO after optimizations, buffer assignment, live ranges) into
DIR/meshlm and DIR/plain.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import tempfile


def compiled_steps(
    config: str,
    batch: int,
    seq: int,
    compute_dtype: str,
    remat: str = "none",
    chip: str | None = None,
    attention: str = "plain",
    dump: str | None = None,
) -> tuple[dict, object]:
    """({impl: compiled step}, target) of meshlm's and plain JAX's step for ``config`` on one device:
    this backend's, or with ``chip`` ("v5e") a compile-only device of that chip (its own compiler).
    ``dump``: XLA's dump of each compilation into ``dump/meshlm`` and ``dump/plain``."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from meshlm.model.config import get_config
    from meshlm.model.transformer import param_shapes
    from meshlm.parallel.compile_target import compiling_for
    from meshlm.parallel.layout import Layout
    from meshlm.parallel.placement import batch_sharding
    from meshlm.perf.plain import plain_step
    from meshlm.perf.plan_target import resolve
    from meshlm.sharding.rules import model_specs, shardings
    from meshlm.train.config import TrainConfig
    from meshlm.train.step import COMPUTE_DTYPES, abstract_opt_state, sharded_step, step_model

    target = resolve(chip, "chip" if chip else "auto", 1)  # one line naming the fix where libtpu is absent
    model = get_config(config).replace(attention=attention)
    cfg = step_model(model, remat=remat, unroll=0, fsdp=False)  # as ``meshlm train`` runs it
    ocfg, dtype = TrainConfig().optim(), COMPUTE_DTYPES[compute_dtype]
    layout = target.place(Layout(dp=1, mp=1))
    shapes = param_shapes(cfg)
    specs = model_specs(cfg, shapes, layout)
    sh = shardings(specs, layout.mesh)
    params = jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, jnp.float32, sharding=h), shapes, sh)
    rows = batch_sharding(layout, 1)
    tokens = {k: jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=rows) for k in ("inputs", "targets")}
    out = {}
    options = lambda impl: {"xla_dump_to": os.path.join(dump, impl)} if dump else {}
    with compiling_for(target.platform):
        step, opt = sharded_step(cfg, ocfg, layout, specs, params, compute_dtype=dtype)
        state = abstract_opt_state(opt, params, specs, layout.mesh)
        out["meshlm"] = step.lower(params, state, tokens).compile(options("meshlm"))
        # plain JAX's arrays carry no mesh of their own: the same one device's, replicated
        one = NamedSharding(layout.mesh, PartitionSpec())
        placed = lambda tree: jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=one), tree
        )
        plain_params = placed(jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), shapes))
        hand, hand_opt = plain_step(cfg, ocfg, plain_params, compute_dtype=dtype)
        hand_state = placed(jax.eval_shape(hand_opt.init, plain_params))
        out["plain"] = hand.lower(plain_params, hand_state, placed(tokens)).compile(options("plain"))
    return out, target


def largest_buffers(folder: str, n: int) -> list[tuple[int, str]]:
    """The ``n`` largest temporaries live at the step's peak (arguments left out), from XLA's dump in
    ``folder`` (its live-range report): (bytes, "name{index} shape op_name") each."""
    (ranges,) = glob.glob(os.path.join(folder, "*jit_step*after_optimizations-live-range.txt"))
    hlo = open(ranges.replace("-live-range.txt", ".txt")).read()
    text = open(ranges).read()
    live = []
    for line in text[text.index("(peak):") :].splitlines()[1:]:
        found = re.match(r"\s+(\S+)\{([^}]*)\}: (\d+) bytes", line)
        if found is None:
            break
        name, index, size = found.groups()
        if re.search(rf"^\s*%{re.escape(name)} = \S+ parameter\(", hlo, re.M):
            continue  # an argument (the parameters, the optimizer state, the batch): the same in both
        live.append((int(size), f"{name}{{{index}}} {_described(hlo, name, index)}"))
    return sorted(live, reverse=True)[:n]


def heap_slots(folder: str, n: int) -> list[tuple[int, str]]:
    """The ``n`` largest slots of the step's memory heap (XLA's memory-usage report, main memory, its
    first table: the heap's slots by size, the smallest left out by XLA): a slot holds buffers whose
    lifetimes do not meet, the heap is the slots side by side; (bytes, "the shapes it holds") each."""
    (report,) = glob.glob(os.path.join(folder, "*jit_step*memory-usage-report.txt"))
    text = open(report).read().split("Memory Space: ")[1]  # the first: the default (main) memory
    slots = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(";")]
        if len(cells) == 5 and cells[2].isdigit():  # cumulative; size; offset; values; shapes
            number, unit = re.match(r"([\d.]+)(\w*)", cells[1]).groups()
            scale = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
            slots.append((int(float(number) * scale), cells[4]))
        elif slots:  # the heap's table ends (the tables after it are single allocations')
            break
    return sorted(slots, reverse=True)[:n]


def _described(hlo: str, name: str, index: str) -> str:
    """The shape (the tuple's element ``index``) and JAX's op_name of instruction ``name``."""
    line = re.search(rf"^\s*(?:ROOT )?%{re.escape(name)} = (.*)$", hlo, re.M)
    if line is None:  # an entry parameter's name as the report spells it
        return ""
    shape = line.group(1).split(" ")[0]
    if shape.startswith("(") and index.isdigit():  # a tuple's element
        tuple_part = line.group(1)[: _closing(line.group(1))]
        shapes = re.findall(r"\b[a-z]+\d*\[[\d,]*\]", re.sub(r"\{[^}]*\}", "", tuple_part))
        shape = shapes[int(index)] if int(index) < len(shapes) else shape
    source = re.search(r'op_name="([^"]*)"', line.group(1))
    op = source.group(1).replace("\\'", "'") if source else ""
    return f"{shape.split('{')[0]} {op}".strip()


def _closing(text: str) -> int:
    """The index just past the parenthesis that closes ``text``'s first."""
    depth = 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return i + 1
    return len(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="llama-100m")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--compute-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--remat", default="none", help="meshlm's --remat (plain JAX's step has none)")
    p.add_argument("--attention", default="plain", help="meshlm's --attention: plain, flash, blockwise")
    p.add_argument("--chip", default=None, help="compile for a compile-only device of this chip (v5e)")
    p.add_argument("--top", type=int, default=0, help="print each step's N largest buffers")
    p.add_argument("--dump", default=None, help="a folder for XLA's dump of both compilations")
    a = p.parse_args()
    dump = a.dump or (tempfile.mkdtemp(prefix="step_memory_") if a.top else None)
    if dump:  # a persistent cache's hit compiles nothing and dumps nothing: off, before JAX starts
        os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    from meshlm.perf.bench import compiled_memory

    steps, target = compiled_steps(
        a.config, a.batch_size, a.seq_len, a.compute_dtype, a.remat, a.chip, a.attention, dump
    )
    mem = {impl: compiled_memory(c) for impl, c in steps.items()}
    print(
        f"{a.config}, batch {a.batch_size} x {a.seq_len}, {a.compute_dtype}, remat {a.remat}, "
        f"meshlm's attention {a.attention}; {target.compiler}"
    )
    parts = ("argument", "output", "alias", "temp", "peak")
    print(f"{'impl':<8}" + "".join(f"{k + ' MB':>14}" for k in parts))
    for impl, m in mem.items():
        print(f"{impl:<8}" + "".join(f"{m[k] / 1e6:>14.1f}" for k in parts))
    ratio = {k: mem["meshlm"][k] / mem["plain"][k] if mem["plain"][k] else float("nan") for k in parts}
    print(f"{'ratio':<8}" + "".join(f"{ratio[k]:>14.3f}" for k in parts))
    for impl in steps if a.top else ():
        print(f"\n{impl}: the {a.top} largest temporaries live at its peak (XLA's live ranges)")
        for size, what in largest_buffers(os.path.join(dump, impl), a.top):
            print(f"{size / 1e6:>10.1f} MB  {what}")
        print(f"{impl}: the {a.top} largest slots of its memory heap (the buffers sharing each)")
        for size, what in heap_slots(os.path.join(dump, impl), a.top):
            print(f"{size / 1e6:>10.1f} MB  {what}")


if __name__ == "__main__":
    main()
