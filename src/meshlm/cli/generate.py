"""meshlm generate: continue prompts with a checkpointed model, KV-cached and sharded on the mesh.

One prompt streams to stdout (the prompt, then the text as it is produced); several are printed one
after another once the batch is done; --json prints the result object (a list of them for several).
Throughput goes to stderr.

--cp N splits the prefill of the (padded) prompts over N context-parallel shards, as training does
(for long prompts); the decode then runs without cp, every cp shard repeating it on its dp x mp part.
"""

from __future__ import annotations

import json
import sys

from meshlm.cli.common import (
    ANY_MESH,
    add_common,
    add_flags,
    checkpoint_model,
    non_negative_float,
    non_negative_int,
    positive_int,
    probability,
    refuse_options,
    settings_from,
    setup,
)
from meshlm.settings import MESH_OPTIONS, MeshFlags

DEFAULT_MAX_NEW = 128  # without --max-new-tokens: this many, or as many as the context still holds
# The mesh options generate runs without (a checkpoint written under any of them loads on any mesh).
# --ep: the experts split, rows over dp; --cp: the prefill split over the sequence (``prefill_cp``).
REFUSED = tuple(o for o in MESH_OPTIONS if o not in ("ep", "cp", "cp_strategy"))
_CP_NOTE = " (prefill over cp, decode without)"


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a checkpoint (KV cache, sharded)")
    add_common(p, None)
    add_flags(p, MeshFlags, "generate", REFUSED)
    p.add_argument("--checkpoint", required=True, help="run directory (newest step) or one step's directory")
    p.add_argument("--prompt", action="append", default=[], help="prompt text; repeat for a batch")
    p.add_argument(
        "--prompt-file", action="append", default=[], help="UTF-8 file whose whole text is one prompt"
    )
    p.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=None,
        help=(
            f"tokens to generate per prompt (default: {DEFAULT_MAX_NEW}, or fewer to fit the context; "
            "a value given here must fit: prompt + new tokens <= the model's context)"
        ),
    )
    # Checked while parsing, before the checkpoint loads (the generator checks them again for library use).
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 is greedy")
    p.add_argument(
        "--top-k", type=non_negative_int, default=0, help="sample from the k most likely tokens (0: all)"
    )
    p.add_argument("--top-p", type=probability, default=1.0, help="nucleus sampling mass in (0, 1] (1: all)")
    p.add_argument("--stop", action="append", default=[], help="stop at this string; repeatable")
    p.add_argument(
        "--speculative",
        choices=("mtp",),
        default=None,
        help=(
            "mtp: self-speculative greedy decoding, the model's MTP depths drafting and the main model "
            "verifying them in one forward (output identical to plain greedy); --json reports the drafts"
        ),
    )
    p.add_argument(
        "--bf16",
        action="store_true",
        help=(
            "weights and KV cache in bfloat16: half the bytes each decode step reads (norms, router and "
            "logits still in float32); tokens may differ from float32's where its logits nearly tie"
        ),
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer.json for a checkpoint converted without one (default: the checkpoint's own)",
    )
    p.set_defaults(fn=run)


def _prompts(args) -> list[str]:
    from meshlm.errors import GenerationError
    from meshlm.generate.inputs import check_utf8, read_prompt_file

    for i, prompt in enumerate(args.prompt):  # before the checkpoint loads
        check_utf8(prompt, f"prompt {i}")
    prompts = list(args.prompt) + [read_prompt_file(f) for f in args.prompt_file]
    if not prompts:
        raise GenerationError("no prompt: pass --prompt TEXT or --prompt-file FILE")
    return prompts


def _default_new(gen, prompts) -> int:
    longest = max(len(gen.encode_prompt(i, p)) for i, p in enumerate(prompts))
    return max(1, min(DEFAULT_MAX_NEW, gen.max_len - longest))  # 1: let generate explain a full context


def _streamer(prompt: str):
    """An on_token callback printing the prompt, then each piece as it comes. The prompt waits for
    the first token so that an input error is not printed after it."""
    started = False

    def on_token(index: int, token: int, piece: str) -> None:
        nonlocal started
        sys.stdout.write(piece if started else prompt + piece)
        sys.stdout.flush()
        started = True

    return on_token


def _tokenizer(args):
    """The checkpoint's tokenizer; ``--tokenizer`` only where it has none, or the same one."""
    from meshlm.train.tokenizers import checkpoint_or_given

    return checkpoint_or_given(args.checkpoint, args.tokenizer)


def _stop_ids(args, tok):
    """The model's own EOS ids where a conversion recorded them, or its carried generation_config.json
    names them (Llama 3: any of several ends the text, as in transformers' generate), else (or if
    none is in the vocabulary) the tokenizer's end-of-document id."""
    from meshlm.data.tokenizer_files import stop_ids
    from meshlm.io.model_io import read_config

    cfg, meta = read_config(args.checkpoint)
    return [i for i in stop_ids(meta, tok) if i < cfg.vocab_size] or tok.eod_id


def run(args) -> int:
    flags = settings_from(args, MeshFlags)
    refuse_options(args, flags, "generate", REFUSED, ANY_MESH)
    prompts = _prompts(args)  # file errors before the slow parts
    if args.speculative:  # sampling: before the devices start
        from meshlm.generate.speculative import check_speculative_run

        check_speculative_run(args.temperature)
    layout = setup(args, flags, model=lambda: checkpoint_model(args.checkpoint))
    from meshlm.generate.generator import cache_memory
    from meshlm.io.model_io import read_config
    from meshlm.parallel.distributed import is_main, print0

    prefill_cp = layout.context_parallel  # with cp: the prefill over cp
    if args.speculative:  # the model's MTP depths and attention, cp: before the weights load
        from meshlm.generate.speculative import check_speculative

        check_speculative(read_config(args.checkpoint)[0], None, args.temperature, prefill_cp)
    if args.bf16:  # before the weights load
        check_bf16(read_config(args.checkpoint)[0])
    tok = _tokenizer(args)  # the checkpoint's own: bytes, or its tokenizer.json
    streaming = not args.json and len(prompts) == 1 and is_main()
    gen, results, spec = _load_and_generate(args, layout, tok, prompts, streaming)
    cache = cache_memory(gen, len(prompts))
    if args.json:
        objs = [{**r.to_json(), "kv_cache": cache} for r in results]
        objs = [{**o, "speculative": s.to_json()} for o, s in zip(objs, spec, strict=True)] if spec else objs
        print0(json.dumps(objs if len(objs) > 1 else objs[0]))
    elif streaming:
        print()
    else:
        for i, r in enumerate(results):
            print0(f"--- prompt {i} ({r.finish_reason}) ---\n{r.prompt}{r.text}")
    r, mesh = results[0], layout.label() + (_CP_NOTE if prefill_cp else "")
    if is_main():
        local = f" ({cache['local_slots']} in local layers)" if "local_slots" in cache else ""
        print(
            f"[{sum(len(x.tokens) for x in results)} tokens; prefill {r.prefill_tokens_per_s:.0f} tok/s, "
            f"decode {r.decode_tokens_per_s:.0f} tok/s; mesh {mesh}; KV cache {cache['slots']} "
            f"positions per layer{local}, {cache['total']:,} bytes{_spec_note(spec)}]",
            file=sys.stderr,
        )
    return 0


def _load_and_generate(args, layout, tok, prompts, streaming: bool) -> tuple:
    """(the Generator, its results, the speculation's stats or None): the weights loaded onto
    ``layout`` and the prompts continued; a device's out-of-memory on the way is one line
    (``generate_asked``)."""
    import jax.numpy as jnp

    from meshlm.generate.generator import Generator, as_run_here, in_dtype
    from meshlm.io.model_io import load_model
    from meshlm.perf.oom import reported

    with reported(lambda: generate_asked(args, layout, len(prompts))):
        cfg, params, _ = load_model(args.checkpoint, layout)
        if args.bf16:  # the cache takes the weights' dtype (``generate.cache``)
            params = in_dtype(params, jnp.bfloat16)
        cfg = as_run_here(cfg)  # the backend's mixture-of-experts dispatch, not the saved config's
        eod = _stop_ids(args, tok)
        gen = Generator(cfg, params, layout, tokenizer=tok, eod=eod, prefill_cp=layout.context_parallel)
        results, spec = _generate(args, gen, prompts, _streamer(prompts[0]) if streaming else None)
    return gen, results, spec


def check_bf16(cfg) -> None:
    """--bf16 only for a family that computes in bf16 (``Family.compute_dtypes``, as train --bf16)."""
    from meshlm.errors import ConfigError

    if "bfloat16" not in cfg.arch.compute_dtypes:
        only = ", ".join(cfg.arch.compute_dtypes)
        raise ConfigError(f"--bf16: {cfg.arch.name} computes in {only} only; drop --bf16")


def generate_asked(args, layout, rows: int) -> str:
    """The out-of-memory line of generate: what was asked, the weights' and the KV cache's bytes per
    device (``meshlm memory``'s count and ``cache_bytes``: float32 as stored), and what cuts memory:
    fewer rows, or a larger mp (the weights and the cache's heads split over it). The cache holds the
    model's whole context (max_seq_len positions) whatever --max-new-tokens is."""
    from meshlm.generate.cache import cache_bytes
    from meshlm.io.model_io import read_config
    from meshlm.perf.memory import memory_report
    from meshlm.perf.oom import device_memory
    from meshlm.units import format_bytes

    cfg = read_config(args.checkpoint)[0]
    kind, limit = device_memory()
    weights = memory_report(cfg, layout)["param_bytes_per_device"] // (2 if args.bf16 else 1)
    padded = -(-rows // layout.dp) * layout.dp  # rows padded to a multiple of dp, as generate pads them
    dtype = "bfloat16" if args.bf16 else "float32"
    cache = cache_bytes(cfg, layout, padded, cfg.max_seq_len, dtype)["per_device"]
    of = f" of its {format_bytes(limit)}" if limit else ""
    return (
        f"out of memory on {kind} in meshlm generate: asked {args.checkpoint} on mesh {layout.label()}, "
        f"{rows} prompts; its weights take {format_bytes(weights)} per device and the KV cache of "
        f"{cfg.max_seq_len} positions per row {format_bytes(cache)}{of} (meshlm memory's counts); cut "
        "memory with fewer prompts per run, or a larger mp (--mesh 1xN splits the weights and the cache's "
        "heads)"
    )


def _generate(args, gen, prompts, on_token) -> tuple:
    """(results, per-prompt ``SpecStats`` with --speculative, else None)."""
    new = args.max_new_tokens if args.max_new_tokens is not None else _default_new(gen, prompts)
    if args.speculative:
        from meshlm.generate.speculative_loop import generate_speculative

        return generate_speculative(gen, prompts, new, stop=args.stop, on_token=on_token)
    kw = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    return gen.generate(prompts, new, stop=args.stop, on_token=on_token, **kw), None


def _spec_note(spec) -> str:
    """The speculation's totals for the stderr line: drafts accepted, tokens per main-model forward."""
    if not spec:
        return ""
    acc, prop = sum(s.accepted for s in spec), sum(s.proposed for s in spec)
    per = sum(s.tokens for s in spec) / sum(s.forwards for s in spec)
    return f"; MTP drafts accepted {acc} of {prop}, {per:.2f} tokens per main forward"
