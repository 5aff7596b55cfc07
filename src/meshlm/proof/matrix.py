"""``meshlm verify --matrix``: the proof over every preset x mesh x option the devices allow.

Presets: one tiny model per block family (ff, gptj, llama; tiny-llama's 4 KV heads replicate on
mp = 8). Meshes: every dp x mp that uses all the devices (N x 1 ... 1 x N). Options: plain, and
z-loss with rematerialised layers (the loss term and the recomputation both proven sharded), and on
meshes with dp > 1 and mp > 1 FSDP + sequence parallelism + selective remat together. Each
cell is the full proof (values, independence, communication, data pipeline, controls); cells the
mesh cannot split (heads not divisible by mp) are listed as skipped with the reason. ``--axes pp,cp``
adds the pipeline's and the context axis's cells, and their pairs, proven or refused with the
layout's own reason (``proof.axes_matrix``).

Compile time dominates these tiny models, so the CLI compiles the matrix with XLA's backend
optimisations off and, on CPU, with XLA's elemental fusion emitters (both sides of every comparison
alike; code generation only: the HLO passes that place collectives run as usual; 8 devices: 735 s ->
422 s, the same verdicts), and shares one compilation cache across cells (the reference is the same
on every mesh).
"""

from __future__ import annotations

import time

import jax.numpy as jnp

from meshlm.errors import ShardingError
from meshlm.model.config import get_config
from meshlm.parallel.mesh import make_mesh
from meshlm.proof.problem import model_problem
from meshlm.proof.prover import verify
from meshlm.proof.report import cell_row

PRESETS = ("tiny", "tiny-gptj", "tiny-llama")
OPTIONS = {"plain": {}, "z-loss + remat": {"z_loss": 1e-3, "remat": "full"}}
# The memory options, on meshes with dp > 1 and mp > 1 only (elsewhere FSDP or SP has nothing to
# split): config changes, then the problem's options.
MEMORY_OPTION = ("fsdp + sp + selective remat", {"remat": "selective"}, {"fsdp": True, "sp": True})
SEQ_LEN = 16


def meshes(n_devices: int) -> list[tuple[int, int]]:
    """Every (dp, mp) with dp * mp == n_devices."""
    return [(n_devices // mp, mp) for mp in range(1, n_devices + 1) if n_devices % mp == 0]


def run_matrix(
    n_devices: int, *, x64: bool = False, steps: int = 0, seed: int = 0, axes: tuple[str, ...] = ()
) -> list[dict]:
    """One row per cell: {"preset", "mesh", "options", "ok" (None when skipped or refused), ...};
    ``axes`` ("pp", "cp"): their cells too (``proof.axes_matrix``), after the others."""
    rows = []
    for preset in PRESETS:
        for dp, mp in meshes(n_devices):
            for option, changes in OPTIONS.items():
                rows.append(_cell(preset, dp, mp, option, changes, x64=x64, steps=steps, seed=seed))
            if dp > 1 and mp > 1:
                option, changes, memory = MEMORY_OPTION
                rows.append(_cell(preset, dp, mp, option, changes, x64=x64, steps=steps, seed=seed, **memory))
    if axes:
        from meshlm.proof.axes_matrix import run_axes_cells

        rows += run_axes_cells(axes, n_devices, x64=x64, steps=steps, seed=seed)
    return rows


def _cell(preset, dp, mp, option, changes, *, x64, steps, seed, fsdp=False, sp=False) -> dict:
    row = {"preset": preset, "mesh": f"{dp}x{mp}", "options": option}
    cfg = get_config(preset).replace(**changes)
    start = time.perf_counter()
    try:
        problem = model_problem(cfg, preset, mp, 2 * dp, SEQ_LEN, seed, dp=dp, fsdp=fsdp, sp=sp)
        report = verify(
            problem,
            make_mesh(dp, mp),
            steps=steps,
            dtype=jnp.float64 if x64 else jnp.float32,
            seed=seed,
            collectives=True,
            data_steps=2,
        )
    except ShardingError as e:
        return {**row, "ok": None, "skipped": str(e)}
    return cell_row(row, report, start)


def format_matrix(rows: list[dict], *, markdown: bool = False) -> str:
    head = ["preset", "mesh", "options", "worst rel. error", "checks", "controls detected", "verdict"]
    body = [[r["preset"], r["mesh"], r["options"], *_result(r)] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join(lines + ["| " + " | ".join(b) + " |" for b in body])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body, strict=True)]
    fmt = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True))
    return "\n".join([fmt(head), fmt(["-" * w for w in widths]), *map(fmt, body)])


def _result(r: dict) -> list[str]:
    if "refused" in r:  # a pair of axes or options the layout does not allow (yet): its own line
        return ["-", "-", "-", f"refused: {r['refused']}"]
    if r["ok"] is None:
        return ["-", "-", "-", f"skipped: {r['skipped']}"]
    return [f"{r['worst_rel_err']:.1e}", r["checks"], r["controls"], "PASS" if r["ok"] else "FAIL"]
