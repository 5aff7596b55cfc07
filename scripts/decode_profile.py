"""Where a decode step's time goes: its compiled cost, memory, and a small profile of ~20 steps.

Issue 64 (decode at the memory roofline): the step is measured, not guessed. For one model and batch
(default llama-100m, batch 8, prompt 512, float32; ``--bf16`` its weights and KV cache in bf16, as
``generate --bf16``) this compiles the two programs it runs (``Generator._executables``: the prefill and
the ``chunk`` of decode steps that generation runs, ``--chunk`` of them, default
``programs.DECODE_CHUNK``) and
prints

* each program's ``cost_analysis()`` (FLOPs, bytes accessed; XLA counts a loop's body once, so the
  chunk's are about one step's) and
  ``memory_analysis()`` (arguments, outputs, aliased, temporaries), next to the roofline's bytes (the
  parameters and the whole KV cache, what a step must read: ``perf.chips.decode_roofline``) and their
  time at the chip's spec bandwidth;
* a ``jax.profiler`` trace of ``--steps`` decode steps (chunks of ``--chunk`` after a prefill, each
  dispatched before the one before is read, as generation runs them), summarised from its Perfetto
  JSON (no TensorBoard needed): the wall time a step, the device's op time a step, the device ops
  (kernels) a step and their median time (a step of many small kernels is bound by their count, not
  its bytes), and the top ops by time (name, ms a step, share, calls). On a TPU the ops are the
  "/device:TPU:0" process's "XLA Ops"; on CPU the XLA CPU client's threads.

``--shrink`` keeps the model's layers and heads but gives them widths that read almost nothing (head dim
8, d_ff 128, vocab 256): the same programs, the same ops a step, ~no bytes. Its step time is the floor
that the op count alone sets (each op's launch and sync on the device), the part of a step no
bandwidth buys back.

The trace stays under --out (default: a temporary directory, deleted). One JSON line last.

    PYTHONPATH=src python scripts/decode_profile.py                 # on the chip, < 60 s
    PYTHONPATH=src python scripts/decode_profile.py --bf16
    PYTHONPATH=src python scripts/decode_profile.py --batch 1 --shrink  # the floor: no bytes to read
    PYTHONPATH=src python scripts/decode_profile.py --cpu-smoke     # tiny-llama, batch 2, CPU
"""

import argparse
import collections
import gzip
import json
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from meshlm.generate.generator import Generator, cache_memory, chunk_tokens, in_dtype
from meshlm.generate.inputs import Sampling, pad_prompts, prompt_doc_starts
from meshlm.generate.programs import DECODE_CHUNK
from meshlm.model.config import get_config
from meshlm.parallel.mesh import make_mesh
from meshlm.perf.chips import device_kind, hbm_bandwidth
from meshlm.train.step import init_model

TOP = 15  # ops listed


def _cost(compiled, steps: int) -> dict:
    """FLOPs and bytes accessed of one program over ``steps`` (XLA counts a loop body once)."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost or {}
    keys = {"flops": "flops", "bytes_accessed": "bytes accessed", "transcendentals": "transcendentals"}
    return {k: float(cost[v]) / steps for k, v in keys.items() if v in cost}


def _memory(compiled) -> dict | None:
    m = compiled.memory_analysis()
    if m is None:
        return None
    fields = ("argument", "output", "alias", "temp", "generated_code")
    return {f: int(getattr(m, f"{f}_size_in_bytes")) for f in fields}


def _perfetto(trace_dir: Path) -> list[dict]:
    """The trace's events (the newest Perfetto JSON under ``trace_dir``)."""
    path = sorted(trace_dir.glob("**/*perfetto_trace.json.gz"))[-1]
    data = json.loads(gzip.open(path).read())
    return data["traceEvents"] if isinstance(data, dict) else data


def _names(events: list[dict]) -> tuple[dict, dict]:
    """({pid: process name}, {(pid, tid): thread name}) of a trace's metadata events."""
    meta = lambda kind: {
        (e["pid"], e.get("tid")) if kind == "thread_name" else e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == kind
    }
    return meta("process_name"), meta("thread_name")


def device_ops(events: list[dict]) -> tuple[list[tuple[str, float]], dict[str, str]]:
    """((op name, microseconds of its own) of every op the device ran, {op name: its HLO text}): a
    "/device:" process's "XLA Ops" thread (a TPU or GPU), else the XLA CPU client's threads (their
    thunks; "end: ..." markers and the waits left out)."""
    procs, threads = _names(events)
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]

    line = lambda e: threads.get((e["pid"], e["tid"]), "")
    device = [e for e in spans if procs.get(e["pid"], "").startswith("/device:")]
    ops = [e for e in device if "XLA Ops" in line(e)]
    if not ops:  # a device trace without an "XLA Ops" line: every line but the steps' and modules'
        ops = [e for e in device if not any(k in line(e) for k in ("Steps", "XLA Modules"))]
    if not ops:  # a CPU: the XLA client's threads
        cpu = ("tf_XLAPjRtCpuClient", "tf_XLAEigen")
        ops = [
            e
            for e in spans
            if line(e).startswith(cpu)
            and not e["name"].startswith(("end: ", "SlinkyThreadPool"))
            and "wait for" not in e["name"]  # the executor waiting on its threads: no work
        ]
    return self_times(ops), _details(ops)


def _details(spans: list[dict]) -> dict[str, str]:
    """Each op name's HLO text where the trace carries it (a TPU's ``long_name``, else its category),
    cut to 160 characters: what a fusion named "fusion.42" computes."""
    out = {}
    for e in spans:
        args = e.get("args") or {}
        text = args.get("long_name") or args.get("hlo_category")
        if text and e["name"] not in out:
            out[e["name"]] = str(text)[:160]
    return out


def self_times(spans: list[dict]) -> list[tuple[str, float]]:
    """(name, microseconds of its own) per span: its duration less its children's on the same thread (a
    loop or a thunk executor holds the ops it runs: their time counted once, in the ops)."""
    out, by_thread = [], collections.defaultdict(list)
    for e in spans:
        by_thread[(e["pid"], e.get("tid"))].append(e)
    for events in by_thread.values():
        stack: list[list] = []  # [end, name, own time]
        for e in sorted(events, key=lambda e: (float(e["ts"]), -float(e["dur"]))):
            start, dur = float(e["ts"]), float(e["dur"])
            while stack and stack[-1][0] <= start:
                out.append(tuple(stack.pop()[1:]))
            if stack:
                stack[-1][2] -= dur
            stack.append([start + dur, e["name"], dur])
        out += [tuple(item[1:]) for item in stack]
    return out


def summarise(ops: list[tuple[str, float]], steps: int, details: dict[str, str] | None = None) -> dict:
    """The device's op time a step and the ``TOP`` ops by total time (with ``details``' HLO text)."""
    total, calls = collections.Counter(), collections.Counter()
    for name, us in ops:
        total[name] += us
        calls[name] += 1
    whole, times = sum(total.values()), sorted(us for _, us in ops)
    top = [
        {
            "op": name,
            "ms_per_step": us / 1e3 / steps,
            "share": us / whole if whole else 0.0,
            "calls": calls[name],
            **({"hlo": details[name]} if details and name in details else {}),
        }
        for name, us in total.most_common(TOP)
    ]
    return {
        "device_ms_per_step": whole / 1e3 / steps,
        "ops_per_step": len(ops) / steps,  # kernels a step (a chunk's loop ops shared by its steps)
        "median_op_us": times[len(times) // 2] if times else 0.0,
        "top_ops": top,
    }


def shrunk(cfg):
    """``cfg``'s layers, heads and programs at widths that read almost nothing (``--shrink``): head dim
    8, d_ff 128, vocabulary 256 (none wider than it was)."""
    d_model = min(cfg.d_model, 8 * cfg.n_heads)
    d_ff, vocab = min(cfg.d_ff, 128), min(cfg.vocab_size, 256)
    return cfg.replace(d_model=d_model, head_dim=0, d_ff=d_ff, vocab_size=vocab)


def _setup(a):
    """(Generator, host prompts [B, S], lengths [B], prompt length, max_len)."""
    cfg = get_config(a.config)
    if a.shrink:
        cfg = shrunk(cfg)
    mesh = make_mesh(1, 1)
    params = init_model(cfg, mesh, 0)[0]
    if a.bf16:
        params = in_dtype(params, jnp.bfloat16)
    chunks = -(-a.steps // a.chunk)
    max_len = a.prompt + 1 + chunks * a.chunk
    gen = Generator(cfg, params, mesh, max_len=max_len, eod=None, chunk=a.chunk)
    rng = np.random.default_rng(0)
    ids = [rng.integers(0, cfg.vocab_size, a.prompt).tolist() for _ in range(a.batch)]
    tokens, lengths = pad_prompts(ids, 1, gen.slots)  # the cache's slots (``programs.slots_for``)
    return gen, tokens, lengths, chunks


def _prefill(gen, tokens, lengths):
    """The prompt's prefill (outside the trace: a decode step's figures are the chunks' alone):
    (first next tokens, KV cache, document starts)."""
    nxt, _, cache = gen.prefill(tokens, lengths, Sampling())
    nxt, starts = np.asarray(nxt), prompt_doc_starts(tokens, lengths, gen.cfg.doc_mask)
    jax.block_until_ready(cache)
    return nxt, cache, starts


def _decode_chunks(gen, lengths, chunks: int, state) -> float:
    """``chunks`` chunks of decode steps after a prefill's ``state`` as generation runs them
    (``generator.chunk_tokens``): their wall seconds."""
    nxt, cache, starts = state
    start = time.perf_counter()
    for _ in chunk_tokens(gen, (nxt, lengths, cache, starts), Sampling(), chunks):
        pass
    return time.perf_counter() - start


def program_us(events: list[dict]) -> float | None:
    """Microseconds the device spent inside programs (its "XLA Modules" line: one span a program run),
    or None where the trace has no such line (a CPU). Against the wall time: what the host adds between
    programs; against the ops' own time: the device's idle gaps between ops inside a program."""
    procs, threads = _names(events)
    on_device = lambda e: procs.get(e["pid"], "").startswith("/device:")
    modules = lambda e: "XLA Modules" in threads.get((e["pid"], e.get("tid")), "")
    spans = [
        float(e["dur"]) for e in events if e.get("ph") == "X" and "dur" in e and on_device(e) and modules(e)
    ]
    return sum(spans) if spans else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="llama-100m")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens a row (default 512)")
    parser.add_argument(
        "--steps", type=int, default=20, help="decode steps profiled (in whole chunks; default 20)"
    )
    parser.add_argument(
        "--chunk", type=int, default=DECODE_CHUNK, help=f"decode steps a program (default {DECODE_CHUNK})"
    )
    parser.add_argument("--bf16", action="store_true", help="weights and KV cache in bf16 (generate --bf16)")
    parser.add_argument(
        "--shrink",
        action="store_true",
        help="the model's layers and heads at widths that read almost nothing (head dim 8, d_ff 128, "
        "vocab 256): the step's floor from its ops, bytes aside",
    )
    parser.add_argument("--out", default=None, help="keep the trace in this directory (default: deleted)")
    parser.add_argument(
        "--cpu-smoke", action="store_true", help="tiny-llama, batch 2, prompt 16, 8 steps (chunks of 4)"
    )
    a = parser.parse_args()
    if a.chunk < 1:
        parser.error(f"--chunk {a.chunk}: give decode steps a program as a whole number >= 1")
    if a.cpu_smoke:
        a.config, a.batch, a.prompt, a.steps, a.chunk = "tiny-llama", 2, 16, 8, 4  # two chunks
    gen, tokens, lengths, chunks = _setup(a)
    exes = gen._executables(a.batch, ("prefill", "chunk"))  # what ``_decode_chunks`` runs
    # XLA's cost analysis counts a loop's body once: the chunk's figures are one step's (its scan body)
    cost = {"chunk": _cost(exes["chunk"], 1)}
    memory = {"chunk": _memory(exes["chunk"])}
    params = sum(x.nbytes for x in jax.tree.leaves(gen.params))
    roof = params + cache_memory(gen, a.batch)["per_device"]
    bandwidth = hbm_bandwidth(device_kind())
    _decode_chunks(gen, lengths, 1, _prefill(gen, tokens, lengths))  # warm: every program run once
    state = _prefill(gen, tokens, lengths)
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(a.out or tmp)
        with jax.profiler.trace(str(where), create_perfetto_trace=True):
            wall = _decode_chunks(gen, lengths, chunks, state)
        steps, events = chunks * a.chunk, _perfetto(where)
        ops, details = device_ops(events)
        trace = summarise(ops, steps, details)
        inside = program_us(events)
        trace["program_ms_per_step"] = None if inside is None else inside / 1e3 / steps
    report = {
        "config": a.config + (" shrunk" if a.shrink else ""),
        "batch": a.batch,
        "prompt": a.prompt,
        "chunk": a.chunk,
        "dtype": "bfloat16" if a.bf16 else "float32",
        "device_kind": device_kind(),
        "cost_per_step": cost,
        "memory": memory,
        "roofline": {
            "bytes": roof,
            "params_bytes": params,
            "ms": 1e3 * roof / bandwidth if bandwidth else None,
            "bytes_accessed_over_roofline": {k: c.get("bytes_accessed", 0) / roof for k, c in cost.items()},
        },
        "trace": {"steps": steps, "wall_ms_per_step": 1e3 * wall / steps, **trace},
    }
    _print(report)
    print(json.dumps(report))


def _print(r: dict) -> None:
    """The report as text, on stderr (the JSON line is stdout's)."""
    roof, trace = r["roofline"], r["trace"]
    what = f"{r['config']} batch {r['batch']} prompt {r['prompt']} {r['dtype']}"
    lines = [f"decode profile: {what} ({r['device_kind']})"]
    gb = lambda x: f"{(x or 0) / 1e9:.3f} GB"
    for kind, c in r["cost_per_step"].items():
        mem = r["memory"][kind] or {}
        lines.append(
            f"  {kind:6s} a step: {c.get('flops', 0) / 1e9:.2f} GFLOP, "
            f"{gb(c.get('bytes_accessed'))} accessed; "
            f"temp {gb(mem.get('temp'))}, arguments {gb(mem.get('argument'))}"
        )
    at = f", {roof['ms']:.3f} ms at spec bandwidth" if roof["ms"] else ""
    lines.append(f"  roofline: {gb(roof['bytes'])} a step (weights {gb(roof['params_bytes'])}){at}")
    inside = trace["program_ms_per_step"]
    inside = f"{inside:.3f} ms inside programs, " if inside is not None else ""
    lines.append(
        f"  trace: {trace['steps']} steps, {trace['wall_ms_per_step']:.3f} ms wall a step, "
        f"{trace['device_ms_per_step']:.3f} ms of device ops a step (self times), {inside}"
        f"{trace['ops_per_step']:.0f} ops a step (median {trace['median_op_us']:.1f} us); top ops:"
    )
    top = trace["top_ops"]
    for o in top:
        hlo = f"  {o['hlo'][:90]}" if "hlo" in o else ""
        lines.append(f"    {o['ms_per_step']:8.4f} ms {o['share']:6.1%} x{o['calls']:<5d} {o['op']}{hlo}")
    print("\n".join(lines), file=sys.stderr)


if __name__ == "__main__":
    main()
