"""Where a decode step's time goes, from the compiler alone: the decode chunk's optimized HLO, read.

Issue 64 (decode at the memory roofline) without a chip: generation's 8-step decode program
(``programs.decode_chunk``) of a preset is compiled ahead of time from ShapeDtypeStructs (nothing is
allocated) for this host, or with ``--chip v5e`` by the chip's own compiler for a compile-only device
(libtpu installed: ``pip install -e '.[tpu-plan]'``; ``perf.plan_target``), with XLA's dump on, and the
script reads the optimized module:

* the kernels one decode step launches (the ops of the chunk's loop body, fusions and the rest: on a
  TPU each costs at least ~1 us, so a step of many small kernels is bound by their count);
* the ops outside the loop that make a new value of the cache's shape (a relayout of the whole
  cache at the program's entry or exit: what the flat cache removed, ``generate.cache``);
* the step's ops that make a new value of one layer's keys or values (``layer_cache_copies``: at batch
  1 the values' matmul fused with its head selection copied each layer's values transposed every step,
  what ``attention._flat_out``'s barrier removed; ``MESHLM_FLAT_VALUES=fused`` compiles the form before);
* the step's moves of a whole stacked cache (``cache_moves_a_step``: async copies into the chip's VMEM
  and back, where the cache fits it; unpriced by the cost model; ``MESHLM_DECODE_XLA_OPTIONS``);
* on a TPU, XLA:TPU's own estimate of each kernel's cycles (``estimated_cycles`` after codegen, at
  ``--clock-ghz``): the step's estimated time and the ops costing most, grouped by the JAX operation
  that made them, beside the roofline (weights and cache read once at the chip's bandwidth).

The estimate is the compiler's cost model, not a measurement (docs/benchmarks.md: 0.86x the measured
step at batch 1, pessimistic for padded einsums). One JSON line last.

    PYTHONPATH=src python scripts/decode_hlo.py --chip v5e --bf16 --batch 64
    PYTHONPATH=src python scripts/decode_hlo.py --config tiny-llama --batch 2 --prompt 16
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import math
import os
import re
import tempfile

PASSED = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant"}  # no kernel of their own


def computations(text: str) -> dict[str, list[str]]:
    """{computation name: its instruction lines} of an HLO module's text ("ENTRY" under its name too)."""
    out, name = {}, None
    for line in text.splitlines():
        header = re.match(r"^(?:ENTRY )?%(\S+) .*\{$", line)
        if header:
            name = header.group(1)
            out[name] = []
            if line.startswith("ENTRY"):
                out["ENTRY"] = out[name]
        elif line.startswith("}"):
            name = None
        elif name and line.strip():
            out[name].append(line)
    return out


def instruction(line: str) -> dict | None:
    """An instruction line's name, shape text, opcode, estimated cycles (0: none) and JAX op name."""
    found = re.match(r"\s*(?:ROOT )?%(\S+) = (.*?) ([a-z][a-z\-]*)\(", line)
    if found is None:
        return None
    cycles = re.search(r'"estimated_cycles":"(\d+)"', line)
    op = re.search(r'op_name="([^"]*)"', line)
    name, shape, opcode = found.groups()
    body = re.search(r"body=%([^,\s]+)", line) if opcode == "while" else None
    return {
        "name": name,
        "shape": shape,
        "opcode": opcode,
        "cycles": int(cycles.group(1)) if cycles else 0,
        "op": op.group(1) if op else "",
        "body": body.group(1) if body else None,
    }


def step_ops(comps: dict[str, list[str]]) -> list[dict]:
    """The ops of one decode step: the body of the entry's loop (the chunk's scan), with the bodies of
    any loops inside it (a layer loop) counted once per trip where XLA states it, else once."""
    entry = [i for i in map(instruction, comps["ENTRY"]) if i]
    loop = next(i for i in entry if i["opcode"] == "while")

    def body(name: str) -> list[dict]:
        ops = []
        for line in comps[name]:
            i = instruction(line)
            if i is None or i["opcode"] in PASSED:
                continue
            if i["body"]:
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                ops += body(i["body"]) * (int(trips.group(1)) if trips else 1)
            else:
                ops.append(i)
        return ops

    return body(loop["body"])


def cache_copies(comps: dict[str, list[str]], shape: tuple) -> list[str]:
    """The entry's ops outside the loop making a new value of the cache's ``shape`` (a relayout)."""
    dims = ",".join(map(str, shape))
    return [
        f"{i['opcode']} {i['shape'].split('{')[0]}"
        for i in filter(None, map(instruction, comps["ENTRY"]))
        if i["opcode"] in ("copy", "fusion", "transpose") and re.match(rf"\w+\[{dims}\]", i["shape"])
    ]


def layer_copies(ops: list[dict], cache_shape: tuple) -> list[str]:
    """The step's ops that make a new value of one layer's cache plane (a copy, fusion or transpose of
    [B, S, F] or [S, F] elements, in any order of its dimensions: a relayout of a layer's keys or values
    every step, as fusing ``attention._flat_out``'s matmul with its selection made at batch 1)."""
    _, b, s, f = cache_shape
    found = []
    for i in ops:
        dims = [int(d) for d in re.findall(r"\[([0-9,]*)\]", i["shape"])[0].split(",") if d]
        plane = s in dims and f in dims and math.prod(dims) in (s * f, b * s * f)
        if plane and i["opcode"] in ("copy", "fusion", "transpose"):
            found.append(f"{i['opcode']} {i['shape'].split('{')[0]}")
    return found


def compile_chunk(config: str, batch: int, prompt: int, new: int, bf16: bool, chip: str | None, dump: str):
    """(compiled chunk, its cache shape, the roofline's bytes, target) for ``config``'s decode at
    ``batch`` rows and a cache for ``prompt + new`` tokens (``programs.slots_for``), on one device,
    XLA's dump into ``dump``."""
    import jax
    import jax.numpy as jnp

    from meshlm.generate.cache import cache_bytes, cache_shapes
    from meshlm.generate.programs import Programs, slots_for
    from meshlm.model.config import get_config
    from meshlm.model.transformer import param_shapes
    from meshlm.parallel.compile_target import compiling_for
    from meshlm.parallel.layout import Layout
    from meshlm.perf.plan_target import resolve
    from meshlm.sharding.rules import model_specs, shardings

    target = resolve(chip, "chip" if chip else "auto", 1)
    dtype = jnp.bfloat16 if bf16 else jnp.float32
    cfg = get_config(config).replace(max_seq_len=max(prompt + new, get_config(config).max_seq_len))
    max_len = slots_for(cfg, prompt + new)  # the cache's slots, as ``Generator`` holds them
    layout = target.place(Layout(dp=1, mp=1))
    shapes = param_shapes(cfg)
    specs = model_specs(cfg, shapes, layout)
    placed = shardings(specs, layout.mesh)
    params = jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, dtype, sharding=h), shapes, placed)
    with compiling_for(target.platform):
        programs = Programs(cfg, layout, specs, max_len, dtype)
        lower = programs.jit["chunk"].lower
        programs.jit["chunk"] = _Dumped(lower, dump)
        chunk = programs.executables(params, batch, ("chunk",))["chunk"]
    weights = sum(jnp.dtype(dtype).itemsize * math.prod(s.shape) for s in jax.tree.leaves(shapes))
    roof = weights + cache_bytes(cfg, layout, batch, max_len, dtype)["per_device"]
    return chunk, cache_shapes(cfg, 1, batch, max_len)["k"], roof, target


class _Dumped:
    """A jitted function's ``lower`` whose ``compile()`` dumps XLA's passes into a folder."""

    def __init__(self, lower, dump: str):
        self.real, self.dump = lower, dump

    def lower(self, *args):
        lowered = self.real(*args)
        dump = {"xla_dump_to": self.dump}  # with the programs' own options (MESHLM_DECODE_XLA_OPTIONS)
        return type(
            "Lowered", (), {"compile": lambda _, opts=None: lowered.compile({**dump, **(opts or {})})}
        )()


def report(dump: str, cache_shape: tuple, roof: int, clock_ghz: float, bandwidth: float | None, top: int):
    """The dump's decode-step summary (module docstring) as a dict."""
    (path,) = glob.glob(os.path.join(dump, "*jit_decode_chunk*after_codegen.txt")) or glob.glob(
        os.path.join(dump, "*jit_decode_chunk*after_optimizations.txt")
    )
    comps = computations(open(path).read())
    ops = step_ops(comps)
    cycles = collections.Counter()
    calls = collections.Counter()
    for i in ops:
        key = f"{i['opcode']} {'/'.join(i['op'].split('/')[-2:])}"
        cycles[key] += i["cycles"]
        calls[key] += 1
    total = sum(cycles.values())
    return {
        "kernels_per_step": len(ops),
        "fusions_per_step": sum(i["opcode"] == "fusion" for i in ops),
        "cache_relayouts": cache_copies(comps, cache_shape),
        "layer_cache_copies": layer_copies(ops, cache_shape),
        # the whole stacked cache moved between HBM and VMEM (S(1)) inside the step: async copies the
        # cost model leaves unpriced, the cache's bytes each way (v5e, where the cache fits its VMEM)
        "cache_moves_a_step": sum(
            i["opcode"] == "copy-start" and f"[{','.join(map(str, cache_shape))}]" in i["shape"] for i in ops
        ),
        "estimated_us_per_step": total / clock_ghz / 1e3 if total else None,
        "roofline_bytes": roof,
        "roofline_us": 1e6 * roof / bandwidth if bandwidth else None,
        "top": [
            {"ops": key, "calls": calls[key], "estimated_us": c / clock_ghz / 1e3}
            for key, c in cycles.most_common(top)
            if c
        ],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="llama-100m")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens a row (default 512)")
    p.add_argument("--new", type=int, default=65, help="new tokens a row: the cache is prompt + new")
    p.add_argument("--bf16", action="store_true", help="weights and KV cache in bf16 (generate --bf16)")
    p.add_argument("--chip", default=None, help="compile for a compile-only device of this chip (v5e)")
    p.add_argument("--clock-ghz", type=float, default=1.5, help="the chip's clock for the estimate (v5e)")
    p.add_argument("--top", type=int, default=12, help="the costliest op groups listed")
    p.add_argument("--dump", default=None, help="keep XLA's dump in this folder (default: deleted)")
    a = p.parse_args()
    os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"  # a cache hit compiles, and dumps, nothing
    from meshlm.perf.chips import hbm_bandwidth
    from meshlm.perf.plan_target import CHIPS

    with tempfile.TemporaryDirectory() as tmp:
        dump = a.dump or tmp
        _, shape, roof, target = compile_chunk(a.config, a.batch, a.prompt, a.new, a.bf16, a.chip, dump)
        bandwidth = hbm_bandwidth(CHIPS[a.chip].device_kind) if a.chip else None
        r = report(dump, shape, roof, a.clock_ghz, bandwidth, a.top)
    what = f"{a.config} batch {a.batch} prompt {a.prompt} + {a.new} {'bf16' if a.bf16 else 'float32'}"
    print(f"decode step of {what}; {target.compiler}")
    print(f"  kernels a step: {r['kernels_per_step']} ({r['fusions_per_step']} fusions)")
    print(f"  relayouts of the whole cache a chunk: {len(r['cache_relayouts'])} {r['cache_relayouts']}")
    print(f"  copies of a layer's keys or values a step: {len(r['layer_cache_copies'])}")
    print(f"  moves of the whole stacked cache a step (to or from VMEM): {r['cache_moves_a_step']}")
    if r["estimated_us_per_step"] is not None:
        roof_us = f", roofline {r['roofline_us']:.0f} us" if r["roofline_us"] else ""
        print(f"  compiler's estimate: {r['estimated_us_per_step']:.0f} us a step{roof_us}; costliest:")
        for t in r["top"]:
            print(f"    {t['estimated_us']:9.1f} us  x{t['calls']:<4d} {t['ops']}")
    print(json.dumps({"config": a.config, "batch": a.batch, "bf16": a.bf16, "chip": a.chip, **r}))


if __name__ == "__main__":
    main()
