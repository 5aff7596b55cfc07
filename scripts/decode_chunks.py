"""Decode in chunks of steps against one step a program, paired in one process.

``Generator.generate`` runs ``programs.DECODE_CHUNK`` decode steps per compiled program
(``decode_chunk``), each chunk dispatched from the one before's device outputs before the host reads
that one's tokens; ``Generator(chunk=0)`` runs one step a program with the host between steps. This
times the same generation both ways, interleaved (``--reps`` repetitions, medians), on a preset with
random weights: decode milliseconds a step (batch / decode tokens per second) for each, and their
ratio. On a chip in the table of ``perf.chips`` it also prints the step's memory roofline (parameters
and KV cache read once at the chip's bandwidth). One JSON line.

    PYTHONPATH=src python scripts/decode_chunks.py --config small --batch 8 --new 65
    PYTHONPATH=src python scripts/decode_chunks.py --config llama-100m --batch 1 --prompt 512 \
        --chunks 8,32,64 --bf16

``--chunks`` times several chunk lengths beside each other (and single steps), each a Generator with its
own programs (``chunk_ran``: the tokens a row each one's chunk program returns): which length hides the
host's work behind the device's (docs/benchmarks.md, "Decode: the step's floor"). The tokens are the
same at any length (the chunk is the single steps' loop, traced).

(docs/benchmarks.md, "Decode: chunks of steps"; tests/test_decode_script.py runs it at tiny size.)
"""

from __future__ import annotations

import argparse
import json
import statistics


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=65, help="new tokens per row (the first from the prefill)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--chunks",
        default=None,
        help="decode steps a program, comma-separated (e.g. 8,32,64), each timed beside the others and "
        "single steps; default: programs.DECODE_CHUNK",
    )
    ap.add_argument("--bf16", action="store_true", help="weights and KV cache in bf16 (generate --bf16)")
    a = ap.parse_args(argv)
    sizes = a.chunks.split(",") if a.chunks else []
    if not all(c.isdigit() and int(c) >= 1 for c in sizes):
        ap.error(f"--chunks {a.chunks!r}: give decode steps a program as whole numbers >= 1, e.g. 8,32,64")

    import jax
    import numpy as np

    import meshlm.generate.generator as generator
    from meshlm.model.config import get_config
    from meshlm.parallel.layout import Layout
    from meshlm.perf.chips import decode_roofline, device_kind
    from meshlm.train.step import init_model

    cfg = get_config(a.config).replace(max_seq_len=a.prompt + a.new)
    layout = Layout.of(jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("dp", "mp")))
    params, _ = init_model(cfg, layout, 0)
    if a.bf16:
        params = generator.in_dtype(params, jax.numpy.bfloat16)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, a.prompt).tolist() for _ in range(a.batch)]
    sizes = [int(c) for c in sizes] or [generator.DECODE_CHUNK]
    # a mode a chunk size, "single" one step a program (chunk 0); each its own Generator and programs
    # (the chunk's length is traced into them), compiled and warm before any is timed
    steps = {("chunk" if i == 0 else f"chunk {c}"): c for i, c in enumerate(sizes)} | {"single": 0}
    modes, made, ran = {}, {}, {}
    for name, c in steps.items():
        modes[name] = gen = generator.Generator(
            cfg, params, layout, max_len=a.prompt + a.new, eod=None, chunk=c
        )
        made[name] = [r.tokens for r in gen.generate(prompts, a.new)]
        if c:  # the tokens a row its chunk program returns: its own length, not another mode's
            ran[name] = gen._executables(a.batch, ("chunk",))["chunk"].out_info[0].shape[1]
    ms = {name: [] for name in modes}
    for _ in range(a.reps):
        for name, gen in modes.items():
            r = gen.generate(prompts, a.new)[0]
            ms[name].append(1e3 * a.batch / r.decode_tokens_per_s)
    gen = modes["chunk"]
    med = {m: statistics.median(v) for m, v in ms.items()}
    rates = generator.bench_generation(cfg, gen.params, layout, a.batch, a.prompt, a.new)
    roof = decode_roofline({"batch": a.batch, **rates}, device_kind())
    out = dict(
        config=a.config, batch=a.batch, prompt=a.prompt, new=a.new, chunk=sizes[0], device=device_kind()
    )
    out["dtype"] = "bfloat16" if a.bf16 else "float32"
    out["same_tokens"] = all(tokens == made["single"] for tokens in made.values())  # greedy: must be
    out["chunk_ran"] = ran
    out |= {"ms_per_step": med, "single_over_chunk": med["single"] / med["chunk"], **roof}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
