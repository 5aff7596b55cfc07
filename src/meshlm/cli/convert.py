"""meshlm convert: transformers GPT-J / Llama / Qwen2 directories to meshlm checkpoints, and back; LoRA
checkpoints to and from peft adapter directories, or merged (``convert_lora``)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from meshlm.cli import convert_lora
from meshlm.cli.common import add_common, setup
from meshlm.data import tokenizer_files as tf
from meshlm.errors import ConfigError


def add_parser(sub) -> None:
    p = sub.add_parser("convert", help="convert Hugging Face GPT-J / Llama / Qwen2 <-> meshlm checkpoints")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-hf", metavar="DIR", help="a transformers directory (config.json + safetensors)")
    src.add_argument("--to-hf", metavar="CKPT", help="a meshlm checkpoint (run or step directory)")
    src.add_argument("--to-peft", metavar="CKPT", help="a LoRA checkpoint: its adapters as a peft directory")
    src.add_argument("--from-peft", metavar="DIR", help="a peft LoRA directory, adapting --base's model")
    src.add_argument("--merge", metavar="CKPT", help="a LoRA checkpoint: the adapters merged into the base")
    p.add_argument("--base", metavar="CKPT", help="with --from-peft: the meshlm checkpoint of its base model")
    p.add_argument("--out", required=True, help="where to write: a new or empty directory")
    add_common(p, None)
    p.set_defaults(fn=run)


def _check_out(out: str) -> None:
    """Never mix a conversion into existing files (a checkpoint directory would gain a step). A live
    command's output is not "not empty": its owner is named (``check_free``)."""
    from meshlm.io.run_lock import LOCK_FILE, check_free

    path = Path(out)
    check_free(path)
    if path.exists() and (not path.is_dir() or any(p.name != LOCK_FILE for p in path.iterdir())):
        raise ConfigError(f"--out {out} exists and is not an empty directory; choose a new path or remove it")


def run(args) -> int:
    _check_out(args.out)
    layout = setup(args, replicated=True)  # no computation: no model dimension split (no mesh to fit)
    from meshlm.parallel.distributed import print0

    if args.base and not args.from_peft:
        raise ConfigError("--base goes with --from-peft (a LoRA checkpoint names its own base)")
    lora = {"to_peft": convert_lora.to_peft, "from_peft": convert_lora.from_peft, "merge": convert_lora.merge}
    chosen = next((fn for name, fn in lora.items() if getattr(args, name)), None)
    if chosen is not None:
        summary = chosen(args, layout, _owned, _summary)
    else:
        summary = _from_hf(args, layout) if args.from_hf else _to_hf(args, layout)
    print0(json.dumps(summary) if args.json else _line(summary))
    return 0


@contextlib.contextmanager
def _owned(out: str):
    """One command per --out, as `train` locks its run: taken once the inputs have been read (a bad
    input leaves no --out behind), held while writing. A collective."""
    from meshlm.io.run_lock import lock_new_dir

    lock = lock_new_dir(Path(out))
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


def _line(s: dict) -> str:
    c = s["config"]
    shape = f"{c['family']} d_model={c['d_model']} n_layers={c['n_layers']} vocab={c['vocab_size']}"
    line = f"converted {s['from']}{_which_step(s)} -> {s['to']} ({s['format']}): {shape}"
    line += f", {s['params']:,} parameters"
    line += f"; tokenizer: {s['tokenizer']}" if "tokenizer" in s else ""  # LoRA's: adapters only
    return line + (f"; {s['dropped']}" if s.get("dropped") else "")


def _which_step(s: dict) -> str:
    """' step N' for an export, and the newer steps it skipped (damaged: the warnings above say how)."""
    if "step" not in s:
        return ""
    skipped = s["skipped_steps"]
    if not skipped:
        return f" step {s['step']}"
    newer = f"step {skipped[0]}" if len(skipped) == 1 else f"steps {', '.join(map(str, skipped))}"
    return f" step {s['step']} (not the newer {newer}: damaged, see the warning above)"


def _from_hf(args, layout) -> dict:
    """Load the HF weights on the host, place each array sharded on the mesh, save a checkpoint."""
    from meshlm.io.hf_weights import load_hf
    from meshlm.io.model_io import abstract_params, save_model
    from meshlm.model.params import flat_params, unflatten
    from meshlm.parallel.placement import put_global
    from meshlm.train import tokenizers as tt  # JAX and orbax: not at the CLI's import
    from meshlm.train.tokenizers import check_vocab

    tok = tf.model_tokenizer(args.from_hf)  # before any weight is read: a bad tokenizer fails fast
    eos = tf.hf_eos_ids(Path(args.from_hf))  # and a broken generation_config.json
    cfg, flat = load_hf(args.from_hf)
    if tok is not None:
        check_vocab(cfg, tok, f"the model in {args.from_hf}")
    targets = flat_params(abstract_params(cfg, layout))
    # put_global copies only each device's own slice, and works multi-process.
    placed = {path: put_global(value, targets[path].sharding) for path, value in flat.items()}
    with _owned(args.out):  # the tokenizer is written into --out too: only once it is ours
        meta = {
            "converted_from": str(Path(args.from_hf).absolute()),
            "tokenizer": tt.tokenizer_meta(args.out, tok),
        }
        if eos:
            meta[tf.EOS_KEY] = eos  # generate stops at any of them, as transformers' generate does
        save_model(args.out, cfg, unflatten(placed), meta=meta)
    return {**_summary(args.from_hf, args.out, "meshlm checkpoint", cfg, flat), "tokenizer": tf.says(tok)}


def _to_hf(args, layout) -> dict:
    """Load the checkpoint sharded, gather every array to the host, write on process 0 only. A LoRA
    checkpoint exports merged: W + (alpha / R) A B, the model its adapters make (as ``--merge``)."""
    import jax

    from meshlm.io.hf_config import config_to_hf, dropped_note
    from meshlm.io.hf_weights import save_hf
    from meshlm.io.layout import complete_steps, resolve
    from meshlm.io.model_io import load_model, read_config
    from meshlm.model import lora
    from meshlm.model.params import flat_params
    from meshlm.parallel.placement import to_host
    from meshlm.train import tokenizers as tt  # JAX and orbax: not at the CLI's import
    from meshlm.train.tokenizers import checkpoint_tokenizer

    first, first_meta = read_config(args.to_hf)
    config_to_hf(lora.without_lora(first))  # an unexportable config fails before loading weights
    if first.lora_rank:  # its own tokenizer, else its base's; the base's stop ids
        tok, base_eos = tt.lora_input(args.to_hf, first_meta, convert_lora.base_path(first_meta))
    else:
        tok, base_eos = checkpoint_tokenizer(args.to_hf, required=False), None
    cfg, params, step = load_model(args.to_hf, layout)  # a run directory: its newest step that loads
    adapted = bool(cfg.lora_rank)
    if adapted:
        cfg, params = lora.without_lora(cfg), lora.merged(cfg, params)
    directory, asked = resolve(args.to_hf)
    skipped = [s for s in complete_steps(directory) if s > step] if asked is None else []
    flat = {path: to_host(v) for path, v in flat_params(params).items()}  # every process gathers
    eos = tf.stop_ids(read_config(directory / str(step))[1], tok) or base_eos  # the exported step's meta
    with _owned(args.out):
        if jax.process_index() == 0:
            save_hf(cfg, flat, args.out)
            tf.write_export(Path(args.out), tok, cfg, eos)
    fmt = "transformers, the LoRA adapters merged" if adapted else "transformers"
    summary = _summary(args.to_hf, args.out, fmt, cfg, flat)
    summary |= {"step": step, "skipped_steps": skipped, "tokenizer": tf.says(tok)}
    summary["dropped"] = dropped_note(cfg)
    return summary


def _summary(src, out, fmt: str, cfg, flat: dict) -> dict:
    params = sum(int(v.size) for v in flat.values())
    return {"from": str(src), "to": str(out), "format": fmt, "params": params, "config": cfg.to_dict()}
