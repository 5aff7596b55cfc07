"""Decode in chunks of steps against one step a program, paired in one process.

``Generator.generate`` runs ``programs.DECODE_CHUNK`` decode steps per compiled program while that many
are left (``decode_chunk``: one dispatch, one set of transfers and one wait a chunk); this times the
same generation both ways, interleaved (``--reps`` repetitions, medians), on a preset with random
weights: decode milliseconds a step (batch / decode tokens per second) for each, and their ratio. On a
chip in the table of ``perf.chips`` it also prints the step's memory roofline (parameters and KV cache
read once at the chip's bandwidth). One JSON line.

    PYTHONPATH=src python scripts/decode_chunks.py --config small --batch 8 --new 65

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
    a = ap.parse_args(argv)

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
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, a.prompt).tolist() for _ in range(a.batch)]
    gen = generator.Generator(cfg, params, layout, max_len=a.prompt + a.new, eod=None)
    chunk, ms = generator.DECODE_CHUNK, {"chunk": [], "single": []}
    for mode in ms:  # compiled and warm, both ways
        generator.DECODE_CHUNK = chunk if mode == "chunk" else 10**9
        gen.generate(prompts, a.new)
    for _ in range(a.reps):
        for mode in ms:
            generator.DECODE_CHUNK = chunk if mode == "chunk" else 10**9
            r = gen.generate(prompts, a.new)[0]
            ms[mode].append(1e3 * a.batch / r.decode_tokens_per_s)
    generator.DECODE_CHUNK = chunk
    med = {m: statistics.median(v) for m, v in ms.items()}
    rates = generator.bench_generation(cfg, gen.params, layout, a.batch, a.prompt, a.new)
    roof = decode_roofline({"batch": a.batch, **rates}, device_kind())
    out = dict(config=a.config, batch=a.batch, prompt=a.prompt, new=a.new, chunk=chunk, device=device_kind())
    out |= {"ms_per_step": med, "single_over_chunk": med["single"] / med["chunk"], **roof}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
