"""What the main job says about itself: at the start, one line naming the model, the mesh and what is
split over which axis; at the end, the commands to run next (sample, prove, measure).

This module must not import jax at module level: the CLI imports it before choosing the devices.
"""

from __future__ import annotations

import shlex

from meshlm.data.records import DEFAULT_FIELD
from meshlm.data.store import is_store
from meshlm.model.config import ModelConfig
from meshlm.parallel.axes import AXES
from meshlm.parallel.layout import Layout
from meshlm.train.config import DEFAULT_PRESET, TrainConfig


def _count(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n / 1e3:.1f}k"


def _devices(mesh) -> str:
    devices = mesh.devices.reshape(-1)
    kind = devices[0].platform
    n = len(devices)
    if kind == "cpu":
        return f"{n} fake CPU device{'s' if n > 1 else ''}" if n > 1 else "1 CPU device"
    return f"{n} {kind.upper()} device{'s' if n > 1 else ''}"


def _model_split(cfg: ModelConfig, mp: int) -> str:
    if mp == 1:
        return "the model whole on every device (mp=1)"
    parts = (
        [f"attention's {cfg.n_heads} heads ({cfg.n_heads // mp} per device)"] if cfg.arch.attention else []
    )
    parts += [
        f"the feed-forward's {cfg.d_ff} hidden units ({cfg.d_ff // mp} each)",
        f"the {cfg.padded_vocab}-row vocabulary ({cfg.padded_vocab // mp} each)",
    ]
    return ", ".join(parts[:-1]) + f" and {parts[-1]} over mp={mp}"


def start_line(tcfg: TrainConfig, cfg: ModelConfig, where, n_params: int) -> str:
    """model: preset, family, parameters; mesh: dp x mp on N devices (``where``: a Layout or a jax
    Mesh); what each axis splits."""
    layout = Layout.of(where) if isinstance(where, Layout) else Layout.of(where, fsdp=tcfg.fsdp, sp=tcfg.sp)
    dp, mp = layout.dp, layout.mp
    before = [(a.name, a.label(layout)[0]) for a in AXES if a.label(layout)[0]]  # as the label: "pp2x"
    legend = " x ".join((*(name for name, _ in before), "dp", "mp"))
    mesh = "".join(piece for _, piece in before) + f"{dp}x{mp} ({legend})"
    batch = (
        f"the batch of {tcfg.batch_size} sequences over dp={dp} ({tcfg.batch_size // dp} each)"
        if dp > 1
        else "the whole batch on every device (dp=1)"
    )
    extra = "; weights and AdamW moments also split over dp (FSDP)" if layout.fsdp else ""
    extra += "; activations between blocks split by position over mp (sequence parallel)" if layout.sp else ""
    extra += layout.explain(cfg)  # each further axis's own words (``parallel.axes.Axis.explain``)
    preset = f"the {tcfg.config or DEFAULT_PRESET} preset"
    model = f"the model of --checkpoint {tcfg.checkpoint}" if tcfg.checkpoint else preset
    return (
        f"model: {model}, a {cfg.family} of {cfg.n_layers} layers, d_model {cfg.d_model}, "
        f"{_count(n_params)} parameters; mesh {mesh} on {_devices(layout.mesh)}: "
        f"{_model_split(cfg, mp)}; {batch}{extra}"
    )


def next_commands(tcfg: TrainConfig, where, tokenizer_file: str | None) -> list[str]:
    """The commands to run next on this run's checkpoint. ``tokenizer_file``: the run's saved
    tokenizer.json (None for bytes). Evaluation uses the run's own validation split: a store's, or
    the one ``data prepare`` makes of the same data (the loader's split, exactly)."""
    out, q = tcfg.out, shlex.quote
    layout = Layout.of(where)
    mesh_flag = f"--mesh {layout.dp}x{layout.mp}"
    lines = [
        f"meshlm generate --checkpoint {q(out)} --prompt {q('def ')}",
        f"meshlm verify --checkpoint {q(out)} {mesh_flag}" + (" --x64" if tcfg.quant == "int8" else ""),
    ]
    if tcfg.objective == "dpo":  # its validation is DPO's own loss, in metrics.jsonl: no eval split
        return lines
    if len(tcfg.data) == 1 and is_store(tcfg.data[0]):
        store = tcfg.data[0]
    else:
        store = out.rstrip("/") + "-valdata"
        data = f" --data {' '.join(map(q, tcfg.data))}" if tcfg.data else ""
        field = f" --text-field {q(tcfg.text_field)}" if tcfg.text_field != DEFAULT_FIELD else ""
        tok = f" --tokenizer {q(tokenizer_file)}" if tokenizer_file else ""
        lines.append(f"meshlm data prepare{data}{field}{tok} --out {q(store)}")
    lines.append(f"meshlm eval --checkpoint {q(out)} --data {q(store)} {mesh_flag}")
    return lines
