"""LoRA adapters as a peft adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``),
which ``peft.PeftModel.from_pretrained`` loads onto the transformers model ``convert --to-hf`` writes of
the base; and back (``convert --to-peft`` / ``--from-peft``).

peft names the adapter of the transformers linear ``<module>.weight`` (the family's tensor names:
``Family.hf``) ``base_model.model.<module>.lora_A.weight`` [R, in] and ``...lora_B.weight`` [out, R],
torch's [out, in] order, its scale ``lora_alpha / r``. Ours (``model.lora``) are A [L, *in, R] and
B [L, R, *out] per layer stack, ``in`` / ``out`` the base weight's dims in its own layout ([D, H, E] of a
query projection: H * E head-major, as transformers views it). What peft can express and meshlm cannot
(rsLoRA, DoRA, biases, per-module ranks, fan_in_fan_out) is refused in one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from meshlm.errors import CheckpointError, ConfigError
from meshlm.io.hf_weights import name_map
from meshlm.model.lora_fields import ADAPTER, targets

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."
# adapter_config.json fields meshlm must see at these values (anything else computes another model)
PLAIN = {"use_rslora": False, "use_dora": False, "bias": "none", "fan_in_fan_out": False}


def _pairs(cfg) -> dict[str, tuple[str, list[str], str]]:
    """Adapter path prefix ("layers/attn/lora_wq") -> (target name, per-layer HF module names, layout)."""
    hf = name_map(cfg)
    out = {}
    for name, path in targets(cfg).items():
        if name not in cfg.lora_targets.split(","):
            continue
        for ours, (hf_names, kind) in hf.items():
            module, leaf = ours.rsplit("/", 1)
            if ours.endswith("/" + path) and leaf == path.rsplit("/", 1)[1]:
                if kind.startswith("fused"):
                    raise ConfigError(
                        f"peft: {cfg.family}'s {path} is a slice of a fused tensor; not exported"
                    )
                modules = [n[: -len(".weight")] for n in hf_names]
                out[f"{module}/{ADAPTER}{leaf}"] = (name, modules, kind)
    return out


def to_peft(cfg, flat: dict, out: str | Path) -> Path:
    """Write ``cfg``'s adapters (``flat``: {"module/leaf": array} of at least the adapters, global)
    as a peft directory in ``out``."""
    from safetensors.numpy import save_file

    tensors, modules = {}, set()
    for prefix, (_, names, _kind) in _pairs(cfg).items():
        a, b = np.asarray(flat[prefix + "_a"], np.float32), np.asarray(flat[prefix + "_b"], np.float32)
        r = a.shape[-1]
        for i, name in enumerate(names):
            tensors[f"{PREFIX}{name}.lora_A.weight"] = np.ascontiguousarray(a[i].reshape(-1, r).T)  # [R, in]
            tensors[f"{PREFIX}{name}.lora_B.weight"] = np.ascontiguousarray(b[i].reshape(r, -1).T)  # [out, R]
            modules.add(name.rsplit(".", 1)[1])
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": cfg.lora_rank,
        "lora_alpha": cfg.lora_alpha or cfg.lora_rank,
        "lora_dropout": cfg.lora_dropout,
        "target_modules": sorted(modules),
        "inference_mode": True,
        "init_lora_weights": True,
        "base_model_name_or_path": None,
        "modules_to_save": None,
        **PLAIN,
    }
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(tensors, path / WEIGHTS, metadata={"format": "pt"})
    return path


def read_peft_config(directory: str | Path, cfg) -> dict:
    """The LoRA fields of ``cfg``'s model (the base) that the peft directory describes; one line for
    what meshlm cannot compute."""
    path = Path(directory) / CONFIG
    if not path.is_file():
        raise ConfigError(f"--from-peft {directory}: no {CONFIG} there (a peft adapter directory has one)")
    config = json.loads(path.read_text())
    if config.get("peft_type") != "LORA":
        raise ConfigError(f"--from-peft {directory}: peft_type {config.get('peft_type')!r}; only LORA")
    odd = {k: config[k] for k, v in PLAIN.items() if config.get(k, v) != v}
    odd |= {k: config[k] for k in ("rank_pattern", "alpha_pattern", "layers_to_transform") if config.get(k)}
    if odd:
        raise ConfigError(f"--from-peft {directory}: {odd} is not plain LoRA, which is what meshlm computes")
    hf_names = {n.rsplit(".", 1)[1]: t for t, n in _module_names(cfg).items()}
    wanted = config.get("target_modules") or []
    wanted = [wanted] if isinstance(wanted, str) else wanted
    unknown = [m for m in wanted if m not in hf_names]
    if unknown:
        raise ConfigError(
            f"--from-peft {directory}: target modules {unknown} are not {cfg.family}'s {list(hf_names)}"
        )
    names = ",".join(t for t in targets(cfg) if t in {hf_names[m] for m in wanted})
    return {"lora_rank": int(config["r"]), "lora_alpha": float(config["lora_alpha"]), "lora_targets": names}


def _module_names(cfg) -> dict[str, str]:
    """Target name -> the first layer's transformers module name of it (e.g. "q" -> "...q_proj")."""
    every = cfg.replace(lora_rank=1, lora_alpha=0.0, lora_targets=",".join(targets(cfg)))
    return {name: modules[0] for name, modules, _ in _pairs(every).values()}


def from_peft(directory: str | Path, cfg) -> dict:
    """{"module/leaf": array} of ``cfg``'s adapters (``cfg``: with ``read_peft_config``'s fields) from
    the peft directory's tensors, every expected one present and no other."""
    from safetensors.numpy import load_file

    tensors = load_file(str(Path(directory) / WEIGHTS))
    tensors = {k.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B."): v
               for k, v in tensors.items()}  # fmt: skip
    shapes = _adapter_shapes(cfg)
    out, used = {}, set()
    for prefix, (_, names, _kind) in _pairs(cfg).items():
        for leaf, key in (("_a", "lora_A"), ("_b", "lora_B")):
            keys = [f"{PREFIX}{n}.{key}.weight" for n in names]
            missing = [k for k in keys if k not in tensors]
            if missing:
                raise CheckpointError(f"--from-peft {directory}: {WEIGHTS} lacks {missing[0]}")
            shape = shapes[prefix + leaf]
            per = [tensors[k].T for k in keys]  # [in, R] / [R, out]
            out[prefix + leaf] = np.stack([p.reshape(shape[1:]) for p in per]).astype(np.float32)
            used.update(keys)
    if extra := sorted(set(tensors) - used):
        raise CheckpointError(f"--from-peft {directory}: tensors meshlm would not use, e.g. {extra[0]}")
    return out


def _adapter_shapes(cfg) -> dict[str, tuple[int, ...]]:
    from meshlm.model.lora import adapters
    from meshlm.model.params import flat_params
    from meshlm.model.transformer import param_shapes

    return {p: tuple(s.shape) for p, s in flat_params(adapters(param_shapes(cfg))).items()}
