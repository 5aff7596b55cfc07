"""meshlm convert: transformers GPT-J / Llama directories to meshlm checkpoints, and back."""

from __future__ import annotations

import json
from pathlib import Path

from meshlm.cli.common import add_common, setup
from meshlm.errors import ConfigError


def add_parser(sub) -> None:
    p = sub.add_parser("convert", help="convert Hugging Face GPT-J / Llama <-> meshlm checkpoints")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-hf", metavar="DIR", help="a transformers directory (config.json + safetensors)")
    src.add_argument("--to-hf", metavar="CKPT", help="a meshlm checkpoint (run or step directory)")
    p.add_argument("--out", required=True, help="where to write: a new or empty directory")
    add_common(p, None)
    p.set_defaults(fn=run)


def _check_out(out: str) -> None:
    """Never mix a conversion into existing files (a checkpoint directory would gain a step)."""
    path = Path(out)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ConfigError(f"--out {out} exists and is not an empty directory; choose a new path or remove it")


def run(args) -> int:
    _check_out(args.out)
    mesh, _, _ = setup(args)
    from meshlm.parallel.distributed import print0

    summary = _from_hf(args, mesh) if args.from_hf else _to_hf(args, mesh)
    print0(json.dumps(summary) if args.json else _line(summary))
    return 0


def _line(s: dict) -> str:
    c = s["config"]
    shape = f"{c['family']} d_model={c['d_model']} n_layers={c['n_layers']} vocab={c['vocab_size']}"
    return f"converted {s['from']} -> {s['to']} ({s['format']}): {shape}, {s['params']:,} parameters"


def _from_hf(args, mesh) -> dict:
    """Load the HF weights on the host, place each array sharded on the mesh, save a checkpoint."""
    from meshlm.io.hf_weights import load_hf
    from meshlm.io.model_io import abstract_params, save_model
    from meshlm.model.params import flat_params, unflatten
    from meshlm.parallel.placement import put_global

    cfg, flat = load_hf(args.from_hf)
    targets = flat_params(abstract_params(cfg, mesh))
    # put_global copies only each device's own slice, and works multi-process.
    placed = {path: put_global(value, targets[path].sharding) for path, value in flat.items()}
    save_model(args.out, cfg, unflatten(placed), meta={"converted_from": str(Path(args.from_hf).absolute())})
    return _summary(args.from_hf, args.out, "meshlm checkpoint", cfg, flat)


def _to_hf(args, mesh) -> dict:
    """Load the checkpoint sharded, gather every array to the host, write on process 0 only."""
    import jax

    from meshlm.io.hf_config import config_to_hf
    from meshlm.io.hf_weights import save_hf
    from meshlm.io.model_io import load_model, read_config
    from meshlm.model.params import flat_params
    from meshlm.parallel.placement import to_host

    config_to_hf(read_config(args.to_hf)[0])  # an unexportable config fails before loading weights
    cfg, params, _ = load_model(args.to_hf, mesh)
    flat = {path: to_host(v) for path, v in flat_params(params).items()}  # every process gathers
    if jax.process_index() == 0:
        save_hf(cfg, flat, args.out)
    return _summary(args.to_hf, args.out, "transformers", cfg, flat)


def _summary(src, out, fmt: str, cfg, flat: dict) -> dict:
    params = sum(int(v.size) for v in flat.values())
    return {"from": str(src), "to": str(out), "format": fmt, "params": params, "config": cfg.to_dict()}
