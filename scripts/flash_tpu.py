"""Flash attention on a TPU chip: equality with plain attention, then step time and compiled memory.

(a) Equality: ``model.flash.flash_attention`` (JAX's Pallas splash kernel, compiled for the chip)
against plain attention (``attention._attend``, its matmuls at 'highest'), float32, forward and the
gradients of q, k, v (and of the sinks): causal, grouped-query, a window, soft-capping, sinks, a
document mask. One JSON line per case: max abs and relative (to the largest value) error.

(b) A full AdamW train step (meshlm's sharded step on one device, ``train.step.sharded_step``) of a
Llama-family model (vocab 16384, d_model 768, 8 layers, d_ff 3072, 12 heads) at T = 2048, 4096, 8192
with attention plain / blockwise / flash: the compiled step's memory (XLA's memory analysis: temp and
peak bytes) and the median step time of ``--steps`` steps after one warm-up. An out-of-memory cell
(compile or run) is reported as such, not fatal. One JSON line per cell.

On the chip (the repository root; about 4 minutes):

    PYTHONPATH=src python scripts/flash_tpu.py

``--cpu-smoke`` runs the same logic on CPU at tiny shapes, the kernel in Pallas interpret mode (a test
runs it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback

CHIP_CASES = [  # name, (B, T, H, K, E), variant fields, document cuts, sinks
    ("causal", (2, 2048, 12, 12, 64), {}, (), False),
    ("causal, grouped-query E=128", (2, 2048, 8, 2, 128), {}, (), False),
    ("window 512", (2, 2048, 8, 2, 128), {"window": 512}, (), False),
    ("soft-cap 50", (2, 2048, 8, 8, 128), {"softcap": 50.0}, (), False),
    ("sinks", (2, 2048, 8, 2, 64), {}, (), True),
    ("document mask", (2, 2048, 8, 2, 128), {}, (300, 1500), False),
    ("padded T=1000", (1, 1000, 8, 8, 128), {}, (), False),
]
SMOKE_CASES = [
    ("causal, grouped-query", (1, 128, 4, 2, 16), {}, (), False),
    ("window, soft-cap, sinks", (1, 128, 2, 1, 16), {"window": 9, "softcap": 5.0}, (), True),
    ("document mask", (1, 128, 2, 2, 16), {}, (40,), False),
]
CHIP_MODEL = dict(vocab_size=16384, d_model=768, n_layers=8, d_ff=3072, n_heads=12, n_kv_heads=12)
SMOKE_MODEL = dict(vocab_size=256, d_model=64, n_layers=2, d_ff=128, n_heads=4, n_kv_heads=2)


def emit(row: dict) -> None:
    print(json.dumps(row), flush=True)


def equality_case(name, shape, fields, cuts, sinks) -> dict:
    """flash vs plain attention, float32: max abs / relative error of the output and every gradient."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from meshlm.model.attention import _attend
    from meshlm.model.attention_variants import Variant
    from meshlm.model.flash import flash_attention

    b, t, h, kh, e = shape
    r = np.random.default_rng(0)
    q, k, v, ct = (
        jnp.asarray(r.normal(size=s), jnp.float32) for s in [(b, t, h, e), *[(b, t, kh, e)] * 2, (b, t, h, e)]
    )
    sink = jnp.asarray(r.normal(size=h), jnp.float32) if sinks else None
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    starts = None
    if cuts:
        row = np.zeros(t, np.int32)
        for c in cuts:
            row[c:] = c
        starts = jnp.asarray(np.broadcast_to(row, (b, t)))
    variant = lambda s: Variant(**fields, sink=s)
    flash = lambda q, k, v, s: flash_attention(q, k, v, starts, variant(s))
    plain = lambda q, k, v, s: _attend(q, k, v, pos, pos, starts, variant(s))

    def both(fn, precision):
        def run(q, k, v, s):
            out, vjp = jax.vjp(fn, q, k, v, s)
            return (out, *vjp(ct))

        with jax.default_matmul_precision(precision):
            return jax.jit(run)(q, k, v, sink)

    got, want = both(flash, "default"), both(plain, "highest")
    names = ("out", "dq", "dk", "dv", "dsink")
    errors = {}
    for n, g, w in zip(names, got, want, strict=True):
        if w is None:
            continue
        abs_err = float(jnp.max(jnp.abs(g - w)))
        errors[n] = {"max_abs": abs_err, "rel": abs_err / float(jnp.max(jnp.abs(w)))}
    worst = max(x["rel"] for x in errors.values())
    return {
        "part": "equality",
        "case": name,
        "shape_BTHKE": list(shape),
        "worst_rel": worst,
        "errors": errors,
    }


def model_config(kind: str, t: int, smoke: bool):
    from meshlm.model.config import get_config

    fields = SMOKE_MODEL if smoke else CHIP_MODEL
    return get_config("tiny-llama").replace(**fields, max_seq_len=t, attention=kind, attn_block=512, unroll=1)


def step_cell(kind: str, t: int, batch: int, steps: int, dtype: str, smoke: bool) -> dict:
    """One (attention, T) cell: compile the train step, read its memory, time ``steps`` steps."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from meshlm.parallel.layout import Layout
    from meshlm.parallel.placement import batch_sharding, put_global
    from meshlm.perf.bench import compiled_memory
    from meshlm.train.optim import OptimConfig
    from meshlm.train.step import init_model, init_opt_state, sharded_step

    cfg, layout = model_config(kind, t, smoke), Layout()
    compute = jnp.bfloat16 if dtype == "bfloat16" else None
    params, specs = init_model(cfg, layout, 0)
    step, opt = sharded_step(cfg, OptimConfig(), layout, specs, params, compute_dtype=compute)
    state = init_opt_state(opt, params, specs, layout.mesh)
    rng = np.random.default_rng(0)
    tokens = lambda: rng.integers(0, cfg.vocab_size, (batch, t), dtype=np.int32)
    data = {k: put_global(tokens(), batch_sharding(layout, 1)) for k in ("inputs", "targets")}
    start = time.perf_counter()
    compiled = step.lower(params, state, data).compile()
    row = {"compile_s": round(time.perf_counter() - start, 2), **_mib(compiled_memory(compiled))}
    seconds = []
    for i in range(steps + 1):  # the first run warms up
        start = time.perf_counter()
        params, state, metrics = compiled(params, state, data)
        jax.block_until_ready(metrics)
        if i:
            seconds.append(time.perf_counter() - start)
    row.update(step_s_median=round(statistics.median(seconds), 5), step_s_min=round(min(seconds), 5))
    row["loss"] = float(np.asarray(jax.device_get(metrics["loss"])).reshape(-1)[0])
    return row


def _mib(memory) -> dict:
    if memory is None:
        return {"memory": None}
    return {f"{k}_mib": round(v / 2**20, 1) for k, v in memory.items()}


def run_cells(a) -> None:
    for t in a.seq_lens:
        for kind in a.kinds:
            row = {"part": "step", "attention": kind, "T": t, "batch": a.batch, "dtype": a.dtype}
            print(f"# step: {kind} T={t} ...", file=sys.stderr, flush=True)
            try:
                row.update(step_cell(kind, t, a.batch, a.steps, a.dtype, a.cpu_smoke))
            except Exception as err:  # an out-of-memory cell (compile or run) is a result, not the end
                text = str(err)
                oom = any(m in text for m in ("RESOURCE_EXHAUSTED", "Ran out of memory", "out of memory"))
                row.update(error="out of memory" if oom else type(err).__name__, detail=_line(err))
                if not oom:
                    traceback.print_exc(file=sys.stderr)
            emit(row)


def _line(err) -> str:
    """The first line of an exception's message (at most 300 characters)."""
    return (str(err).splitlines() or [""])[0][:300]


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu-smoke", action="store_true", help="CPU, tiny shapes, the kernel in interpret mode")
    p.add_argument(
        "--seq-lens", type=int, nargs="+", default=None, help="default 2048 4096 8192 (smoke: 128)"
    )
    p.add_argument("--kinds", nargs="+", default=["plain", "blockwise", "flash"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=5, help="timed steps per cell after one warm-up")
    p.add_argument(
        "--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="the step's compute dtype"
    )
    p.add_argument("--skip-equality", action="store_true")
    p.add_argument("--skip-steps", action="store_true")
    a = p.parse_args(argv)
    if a.seq_lens is None:
        a.seq_lens = [128] if a.cpu_smoke else [2048, 4096, 8192]
    if a.cpu_smoke:
        a.steps = min(a.steps, 1)
    return a


def main(argv=None) -> None:
    a = parse(argv)
    import jax

    if a.cpu_smoke:
        jax.config.update("jax_platforms", "cpu")
    elif jax.default_backend() != "tpu":
        print(
            "flash_tpu.py: no TPU here (jax.default_backend() is not tpu); add --cpu-smoke to run on CPU",
            file=sys.stderr,
        )
        sys.exit(2)
    emit(
        {
            "part": "device",
            "backend": jax.default_backend(),
            "device": str(jax.devices()[0]),
            "jax": jax.__version__,
        }
    )
    start = time.perf_counter()
    if not a.skip_equality:
        for case in SMOKE_CASES if a.cpu_smoke else CHIP_CASES:
            print(f"# equality: {case[0]} ...", file=sys.stderr, flush=True)
            try:
                emit(equality_case(*case))
            except Exception as err:  # one failing case is a result; the others and the steps still run
                traceback.print_exc(file=sys.stderr)
                emit({"part": "equality", "case": case[0], "error": type(err).__name__, "detail": _line(err)})
    if not a.skip_steps:
        run_cells(a)
    emit({"part": "done", "seconds": round(time.perf_counter() - start, 1)})


if __name__ == "__main__":
    main()
