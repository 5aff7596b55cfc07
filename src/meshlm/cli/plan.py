"""meshlm plan: one device's memory for a training run, from the real train step compiled ahead of time
on abstract shapes (nothing of the model is allocated), next to an analytic estimate; with
--device-memory, whether it fits and which options would make it fit. See ``meshlm.perf.plan``."""

from __future__ import annotations

import json
import os
from pathlib import Path

from meshlm.cli.common import (
    add_common,
    add_flags,
    argparse_type,
    checkpoint_model,
    flag_layout,
    settings_from,
    setup,
)
from meshlm.errors import ConfigError
from meshlm.model.config import default_seq_len
from meshlm.parallel.axes import PP
from meshlm.perf.plan_settings import DEFAULT_CONFIG, PlanCommand
from meshlm.train.lora import with_lora
from meshlm.units import parse_bytes

memory_size = argparse_type(parse_bytes)  # --device-memory's type: "80GiB" -> bytes


def add_parser(sub) -> None:
    p = sub.add_parser(
        "plan", help="memory per device of a training run: compiled ahead of time, and whether it fits"
    )
    add_common(p)  # --devices defaults to the --mesh's size here: the planner runs nothing
    add_flags(p, PlanCommand)
    p.set_defaults(fn=run)


def _preset(pc: PlanCommand):
    """(config, its name) of a preset (no JAX needed), or None for a checkpoint's model."""
    from meshlm.model.config import get_config

    if pc.checkpoint is None:
        name = pc.config or DEFAULT_CONFIG
        cfg = get_config(name)
        return (cfg if pc.quant is None else cfg.replace(quant=pc.quant)), name
    if pc.config is not None:
        raise ConfigError("give --config or --checkpoint, not both (a checkpoint names its own model)")
    return None


def _fast_compiles() -> None:
    """The planner never runs the step: XLA's backend (LLVM) optimisation only costs compile time.
    Without it the buffer plan is the same (llama2-7b: identical temporaries) in about half the time."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_backend_optimization_level" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_backend_optimization_level=0".strip()


def run(args) -> int:
    pc = settings_from(args, PlanCommand)
    model = _preset(pc)
    if pc.schedule_png and not pc.on(PP):
        raise ConfigError("--schedule-png draws a pipeline schedule; add --pp 2 (or more)")
    # --fsdp and --sp are the planned run's (``PlanSettings.on`` puts each candidate's on the layout)
    planned = flag_layout(args, pc)
    if model is not None and planned:  # what needs no devices is checked before them
        pc.settings(model[0], planned).check(model[0], planned)
    from meshlm.perf.plan_target import check_chip, resolve

    check_chip(pc.chip, pc.compiler)
    if planned and args.devices is None:  # nothing runs: as many fake devices as the mesh needs
        args.devices = planned.devices
    _fast_compiles()
    layout = setup(args, pc, planned, model=lambda: model[0] if model else checkpoint_model(pc.checkpoint))
    from meshlm.perf.plan_report import format_plan
    from meshlm.perf.plan_search import plan

    if model is None:
        from meshlm.io.model_io import read_config

        saved = read_config(pc.checkpoint)[0]
        model = (saved if pc.quant is None else saved.replace(quant=pc.quant), f"checkpoint {pc.checkpoint}")
    cfg, name = model
    # the chip (--chip) and its compiler, or this host's; "auto" resolves for the platform compiled
    # for: flash on a TPU where it applies and pays; ragged_dot on TPU and GPU
    target = resolve(pc.chip, pc.compiler, layout.devices)
    backend = target.platform
    seq_len = default_seq_len(cfg, pc.seq_len or 0)  # what auto decides on
    attention, dispatch = pc.attention_kind(backend, seq_len), pc.dispatch_fields(backend)  # the run's rows
    cfg = cfg.replace(attention=attention, attn_block=pc.attn_block, loss_chunk=pc.loss_chunk, **dispatch)
    cfg = with_lora(pc, cfg)  # LoRA: adapters
    report = plan(
        cfg,
        name,
        layout,
        pc.settings(cfg, layout),
        device_bytes=pc.device_bytes(),
        max_compiles=pc.max_compiles,
        every_option=pc.every_option,
        target=target,
    )
    if pc.device_memory is None and target.chip is not None:
        report["device_memory_from"] = f"--chip {target.chip.name}: {target.chip.memory_source}"
    if pc.schedule_png:
        from meshlm.parallel.pipeline_schedule import schedule_table
        from meshlm.perf.schedule_png import draw_schedule

        path = draw_schedule(schedule_table(layout.pipeline), Path(pc.schedule_png))
        report["schedule_png"] = str(path)
    print(json.dumps(report) if args.json else format_plan(report))
    # The answer to "will it fit?" as the exit status, for scripts: 1 when the run does not fit
    # --device-memory and no option tried makes it fit (the report says so), else 0.
    row = report["plan"]
    return 1 if report["device_memory"] is not None and not row["fits"] and not report["recommended"] else 0
