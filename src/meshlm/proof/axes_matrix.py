"""``meshlm verify --matrix --axes pp,cp``: the pipeline's and the context axis's cells of the matrix.

Opt-in (each cell is a full proof of a pipelined or context-parallel step; the default matrix stays as
it was): every pp schedule (gpipe, 1f1b, interleaved) and every cp strategy (ring, allgather), each
plain and with FSDP + SP, on tiny-deep (8 layers: interleaved needs V >= 2 chunks per stage), and
every pair of the two axes together. A cell is proven, or refused with the layout's own one-line
``ConfigError`` (what ``meshlm verify`` with those flags prints), or skipped when the devices are too
few: when a refused pair becomes possible (``Layout`` accepts it) its cell is a proof with no change
here. Shapes are verify's defaults (``proof.defaults``): micro-batches 2 pp, V the smallest that
exposes a wrong chunk order, one row per data shard per micro-batch, blocks that cut each cp shard's
sequence into several.
"""

from __future__ import annotations

import time

import jax.numpy as jnp

from meshlm.errors import ConfigError, ShardingError
from meshlm.model.config import get_config
from meshlm.parallel.axes import CP, CP_STRATEGIES, PP, sizes_on
from meshlm.parallel.layout import Layout
from meshlm.parallel.pipeline_schedule import SCHEDULES
from meshlm.proof import defaults
from meshlm.proof.problem import model_problem
from meshlm.proof.prover import verify
from meshlm.proof.report import cell_row

AXES = ("pp", "cp")
PRESET = "tiny-deep"
SEQ_LEN = 24  # over cp 2 with sp on mp 2: 2 cp x 2 chunks x 2 mp divide it; 12 tokens per cp shard
MEMORY = {"plain": {}, "fsdp + sp": {"fsdp": True, "sp": True}}


def parse_axes(text: str) -> tuple[str, ...]:
    """ "pp,cp" -> ("pp", "cp"); an unknown name is one line."""
    names = tuple(a for a in text.split(",") if a)
    if unknown := [a for a in names if a not in AXES]:
        raise ConfigError(
            f"--axes {text}: {', '.join(unknown)} is not one of {', '.join(AXES)}; pick from them"
        )
    return names


def axes_cells(axes: tuple[str, ...]) -> list[tuple[str, dict]]:
    """(options' label, Layout fields) of each cell: each schedule / strategy with each memory option
    (dp 2 x mp 2), and with both axes every schedule x strategy pair (dp 1 x mp 2)."""
    pp = lambda s: dict(pp=2, pp_schedule=s, microbatches=defaults.microbatches(2), virtual_stages=_v(s))
    cells = []
    if "pp" in axes:
        cells += [
            (f"pp2 {s}, {m}", dict(dp=2, mp=2, **pp(s), **kw)) for s in SCHEDULES for m, kw in MEMORY.items()
        ]
    if "cp" in axes:
        cells += [
            (f"cp2 {c}, {m}", dict(dp=2, mp=2, cp=2, cp_strategy=c, **kw))
            for c in CP_STRATEGIES
            for m, kw in MEMORY.items()
        ]
    if {"pp", "cp"} <= set(axes):
        cells += [
            (f"pp2 {s} x cp2 {c}", dict(mp=2, cp=2, cp_strategy=c, **pp(s)))
            for s in SCHEDULES
            for c in CP_STRATEGIES
        ]
    return cells


def _v(schedule: str) -> int:
    return defaults.virtual_stages(2, get_config(PRESET)) if schedule == "interleaved" else 1


def run_axes_cells(axes: tuple[str, ...], n_devices: int, *, x64: bool, steps: int, seed: int) -> list[dict]:
    return [
        _cell(label, fields, n_devices, x64=x64, steps=steps, seed=seed) for label, fields in axes_cells(axes)
    ]


def _mesh_text(fields: dict) -> str:
    """The cell's mesh as the layout's label words it ("pp2x1x2 + CP2 ring"), for a layout refused."""
    mesh = f"{fields.get('dp', 1)}x{fields['mp']}"
    mesh = f"pp{fields['pp']}x{mesh}" if sizes_on(fields, PP) else mesh
    return mesh + (f" + CP{fields['cp']} {fields['cp_strategy']}" if sizes_on(fields, CP) else "")


def _cell(label: str, fields: dict, n_devices: int, *, x64: bool, steps: int, seed: int) -> dict:
    row = {"preset": PRESET, "mesh": _mesh_text(fields), "options": label}
    try:
        layout = Layout(**fields)
    except ConfigError as e:  # the pair is not allowed (yet): the layout's own line
        return {**row, "ok": None, "refused": str(e)}
    row["mesh"] = layout.label()
    if layout.devices > n_devices:
        return {**row, "ok": None, "skipped": f"needs {layout.devices} devices, {n_devices} here"}
    cfg = get_config(PRESET)
    kernel = layout.cp_ring  # the ring runs the blockwise kernel: several blocks per shard
    cfg = cfg.replace(attn_block=defaults.block_for(SEQ_LEN // layout.cp)) if kernel else cfg
    start = time.perf_counter()
    try:
        layout.check_seq_len(SEQ_LEN)
        batch = defaults.batch_rows(layout.dp, layout.pipeline_microbatches)
        problem = model_problem(cfg, PRESET, layout, batch, SEQ_LEN, seed)
        dtype = jnp.float64 if x64 else jnp.float32
        report = verify(problem, layout, steps=steps, dtype=dtype, seed=seed, collectives=True, data_steps=2)
    except ShardingError as e:
        return {**row, "ok": None, "skipped": str(e)}
    except ConfigError as e:  # the model on this layout (a strategy's check): refused as above
        return {**row, "ok": None, "refused": str(e)}
    return cell_row(row, report, start)
