"""meshlm convert: transformers GPT-J / Llama / Qwen2 directories to meshlm checkpoints, and back; LoRA
checkpoints to and from peft adapter directories, or merged (``convert_lora``)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from meshlm.cli import convert_lora
from meshlm.cli.common import add_common, setup
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
    from meshlm.io.tokenizer_file import NONE_ENTRY
    from meshlm.model.params import flat_params, unflatten
    from meshlm.parallel.placement import put_global
    from meshlm.train.tokenizers import check_vocab, tokenizer_meta

    tok = _hf_tokenizer(args.from_hf)  # before any weight is read: a bad tokenizer.json fails fast
    cfg, flat = load_hf(args.from_hf)
    if tok is not None:
        check_vocab(cfg, tok, f"the model in {args.from_hf}")
    targets = flat_params(abstract_params(cfg, layout))
    # put_global copies only each device's own slice, and works multi-process.
    placed = {path: put_global(value, targets[path].sharding) for path, value in flat.items()}
    with _owned(args.out):  # the tokenizer is written into --out too: only once it is ours
        entry = tokenizer_meta(args.out, tok) if tok is not None else dict(NONE_ENTRY)
        meta = {"converted_from": str(Path(args.from_hf).absolute()), "tokenizer": entry}
        eos = _hf_eos_ids(Path(args.from_hf))
        if eos:
            meta[EOS_KEY] = eos  # generate stops at any of them, as transformers' generate does
        save_model(args.out, cfg, unflatten(placed), meta=meta)
    return {**_summary(args.from_hf, args.out, "meshlm checkpoint", cfg, flat), "tokenizer": _says(tok)}


def _hf_tokenizer(directory: str):
    """The model directory's tokenizer.json (its EOD from tokenizer_config.json), or None: the
    summary line then says that the model takes token ids only."""
    from meshlm.data.tokenizer import load_tokenizer

    path = Path(directory) / "tokenizer.json"
    return load_tokenizer(path) if path.is_file() else None


EOS_KEY = "eos_token_ids"  # a converted checkpoint's meta: the model's own EOS ids (config.json's)


def _hf_eos_ids(directory: Path) -> list[int]:
    """The ids ``generate(do_sample=False)`` stops at: generation_config.json's eos_token_id, else
    config.json's; an int or a list (Llama 3 Instruct: three). [] where neither names one."""
    for name in ("generation_config.json", "config.json"):
        path = directory / name
        try:
            eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
        except (OSError, ValueError, AttributeError):  # absent or unreadable: config.json's own
            continue  # errors were reported by load_hf already
        ids = [eos] if isinstance(eos, int) and not isinstance(eos, bool) else eos
        if eos is None:
            continue
        if not isinstance(ids, list) or not all(type(i) is int and i >= 0 for i in ids):
            raise ConfigError(f"{path}: eos_token_id={eos!r} must be a token id or a list of ids; correct it")
        return ids  # an id >= the vocabulary (GPT-J's default 50256 on a small model) is never produced
    return []


def _says(tok) -> str:
    if tok is None:
        return (
            "none (no tokenizer.json in the model directory): the model can only take token ids; "
            "generate and train need a tokenizer (train --tokenizer, or convert with tokenizer.json)"
        )
    return tok.describe() + ("" if tok.kind == "bytes" else ": tokenizer.json")


def _to_hf(args, layout) -> dict:
    """Load the checkpoint sharded, gather every array to the host, write on process 0 only."""
    import jax

    from meshlm.io.hf_config import config_to_hf, dropped_note
    from meshlm.io.hf_weights import save_hf
    from meshlm.io.layout import complete_steps, resolve
    from meshlm.io.model_io import load_model, read_config
    from meshlm.model.params import flat_params
    from meshlm.parallel.placement import to_host
    from meshlm.train.tokenizers import checkpoint_tokenizer

    config_to_hf(read_config(args.to_hf)[0])  # an unexportable config fails before loading weights
    tok = checkpoint_tokenizer(args.to_hf, required=False)
    cfg, params, step = load_model(args.to_hf, layout)  # a run directory: its newest step that loads
    directory, asked = resolve(args.to_hf)
    skipped = [s for s in complete_steps(directory) if s > step] if asked is None else []
    flat = {path: to_host(v) for path, v in flat_params(params).items()}  # every process gathers
    with _owned(args.out):
        if jax.process_index() == 0:
            save_hf(cfg, flat, args.out)
            eos = read_config(directory / str(step))[1].get(EOS_KEY)  # the exported step's meta
            _write_hf_tokenizer(Path(args.out), tok, cfg, eos)
    summary = _summary(args.to_hf, args.out, "transformers", cfg, flat)
    summary |= {"step": step, "skipped_steps": skipped, "tokenizer": _says(tok), "dropped": dropped_note(cfg)}
    return summary


def _write_hf_tokenizer(out: Path, tok, cfg, eos: list[int] | None) -> None:
    """tokenizer.json + tokenizer_config.json (``AutoTokenizer.from_pretrained(out)`` loads them), and
    the EOD (or the model's own EOS ids, ``eos``) as config.json's eos_token_id so that transformers'
    generate stops where meshlm's does."""
    if eos:
        _set_eos(out, eos if len(eos) > 1 else eos[0])
    if tok is None or tok.kind == "bytes":
        return  # bytes: transformers has no byte tokenizer to name; ids are the UTF-8 bytes
    (out / "tokenizer.json").write_text(tok.to_json(), encoding="utf-8")
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": tok.eod_token,
        "model_max_length": cfg.max_seq_len,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    if not eos:
        _set_eos(out, tok.eod_id)


def _set_eos(out: Path, eos: int | list[int]) -> None:
    config = json.loads((out / "config.json").read_text())
    config["eos_token_id"] = eos
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _summary(src, out, fmt: str, cfg, flat: dict) -> dict:
    params = sum(int(v.size) for v in flat.values())
    return {"from": str(src), "to": str(out), "format": fmt, "params": params, "config": cfg.to_dict()}
