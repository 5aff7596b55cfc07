"""The planner's report, and its search for settings that fit a device's memory.

Every candidate is a compile of the real step (a few seconds for llama2-7b on 2 CPU cores), so the
search is short and each candidate is compiled once (``Planner.evaluate`` caches by settings, and
stops at ``max_compiles``):

  1. each option alone on top of the given settings, cheapest first, until one fits with room to
     spare: --sp, --fsdp, --remat selective, twice the --accum-steps (half the micro-batch),
     --remat full (only the options this meshlm supports, and that the mesh and sizes allow:
     fsdp needs dp > 1, sp needs mp > 1); with ``every_option`` all of them;
  2. if none of them fits, the options stacked in that order, then the micro-batch halved again
     until it fits or is one row per device.

The order is the cost in step time: sequence parallelism costs no extra communication volume,
FSDP gathers weights, selective remat recomputes the cheap attention work, a smaller micro-batch
makes smaller matmuls, full remat recomputes every layer's forward (about a third more compute).
The recommendation is the cheapest candidate that fits with 10% of the device to spare (else the
cheapest that fits at all).
"""

from __future__ import annotations

import dataclasses

import jax

from meshlm.errors import MeshlmError
from meshlm.model.config import ModelConfig, named_remat_blockers
from meshlm.parallel.layout import Layout
from meshlm.perf.plan import ADAM_MOMENTS, MOMENT_SCALE, analytic, measure, state_bytes
from meshlm.perf.plan_calibration import policy
from meshlm.perf.plan_settings import PlanSettings
from meshlm.perf.plan_target import Target, resolve

CPU_NOTE = (
    "compiled by XLA for host CPU devices: the temporaries and peak are XLA CPU's buffer plan, an "
    "estimate of an accelerator's (whose compiler fuses and schedules differently; --chip v5e plans "
    "with a TPU's); runtime overheads (CUDA context, allocator fragmentation) are not included"
)
ANALYTIC_NOTE = (
    "analytic activations: Korthikanti et al. 2022 per layer (a GPT block: 4h GeLU MLP, multi-head "
    "attention, dropout masks; a mixture of experts' dispatch buffers in place of its MLP), their "
    "16-bit figures scaled to the compute dtype, + float32 logits; no copy of the AdamW moments (the "
    "update writes them in place)"
)
# step-time cost of each option (save_qkv_mlp_in recomputes more than selective, less than full)
COSTS = {"sp": 0, "fsdp": 1, "selective": 2, "save_qkv_mlp_in": 3, "accum": 4, "full": 5}
STACK_ORDER = ("sp", "fsdp", "selective", "full", "accum")
DEFAULT_MAX_COMPILES = 8
# A fit with less than this fraction of the device free is "tight": the CPU-compiled peak is an
# estimate, so a looser fit is recommended over a cheaper tight one.
TIGHT = 0.1


def moves(settings: PlanSettings, dp: int, mp: int, named: bool = True) -> list[tuple[str, PlanSettings]]:
    """The single changes to ``settings`` worth trying, cheapest first: (option, new settings);
    ``named``: the model's layers have what a named remat policy saves (``named_remat_blockers``)."""
    replace = lambda **kw: dataclasses.replace(settings, **kw)
    found = []
    if not settings.sp and mp > 1 and settings.seq_len % mp == 0:
        found.append(("sp", replace(sp=True)))
    if not settings.fsdp and dp > 1:
        found.append(("fsdp", replace(fsdp=True)))
    if settings.remat == "none":
        found.append(("selective", replace(remat="selective")))
    if named and settings.remat in ("none", "selective"):
        found.append(("save_qkv_mlp_in", replace(remat="save_qkv_mlp_in")))
    if settings.batch_size % (dp * settings.accum_steps * 2) == 0:
        found.append(("accum", replace(accum_steps=settings.accum_steps * 2)))
    if settings.remat != "full":
        found.append(("full", replace(remat="full")))
    return found


def cost(settings: PlanSettings, base: PlanSettings) -> int:
    """How much step time ``settings`` gives up against ``base`` (for ranking; 0 = the same)."""
    total = COSTS["sp"] * (settings.sp > base.sp) + COSTS["fsdp"] * (settings.fsdp > base.fsdp)
    if settings.remat != base.remat:
        total += COSTS.get(settings.remat, COSTS["selective"])
    halvings = (settings.accum_steps // base.accum_steps).bit_length() - 1
    return total + COSTS["accum"] * halvings


_MEASURED: dict = {}  # (config, layout, mesh, settings, platform) -> measure(...): once per process


def measured(cfg: ModelConfig, layout: Layout, settings: PlanSettings, platform: str | None = None) -> dict:
    """``measure``, remembered for this process (a plan's candidates recur across plans)."""
    key = (cfg, layout, layout.mesh, settings, platform)
    if key not in _MEASURED:
        _MEASURED[key] = measure(cfg, layout, settings, platform)
    return dict(_MEASURED[key])


class Planner:
    """Compiles and estimates candidates for one model on one mesh (``layout``; each candidate's
    settings give the memory options), each at most once."""

    def __init__(
        self,
        *,
        cfg: ModelConfig,
        layout: Layout,
        device_bytes: int | None,
        max_compiles: int,
        every_option: bool,
        target: Target,
        base_dtype: str = "float32",
    ):
        self.cfg, self.layout, self.target = cfg, layout, target
        self.device_bytes = device_bytes
        self.max_compiles = max_compiles
        self.every_option = every_option  # step 1 tries every option, not only up to the first fit
        self.named = not named_remat_blockers(cfg)  # named remat policies apply to its layers
        self.rows: dict[PlanSettings, dict] = {}
        state = state_bytes(cfg, layout, PlanSettings(batch_size=1, seq_len=1, base_dtype=base_dtype))
        self.base_dtype = base_dtype  # LoRA: the frozen base's stored dtype (its bytes above)
        # the unsharded state: parameters, and AdamW moments of those trained (LoRA: the adapters)
        self.unsharded, self.unsharded_opt = state["params_total"], ADAM_MOMENTS * state["trained_total"]

    def evaluate(self, settings: PlanSettings, *, strict: bool = False) -> dict | None:
        """The row for ``settings`` (compiled once); None when the compile budget is spent. A
        candidate that cannot be built is a row with its error, unless ``strict`` (the user's own)."""
        if settings in self.rows:
            return self.rows[settings]
        if len(self.rows) >= self.max_compiles:
            return None
        row = {"label": settings.label(), "settings": dataclasses.asdict(settings)}
        try:
            row["compiled"] = measured(self.cfg, self.layout, settings, self.target.platform)
            row["analytic"] = analytic(self.cfg, self.layout, settings)
            if self.target.correction is not None:  # the host's plan, its temporaries corrected for the chip
                a = row["analytic"]  # the state's temporaries, the same bytes on every compiler
                state = a["gradients"] + a["moment_copies"] + a["gathered"]
                key = policy(settings.remat, settings.accum_steps)
                row["corrected"] = self.target.correction.apply(row["compiled"], key, state)
        except MeshlmError as e:
            if strict:
                raise
            row["error"] = str(e)
        self.rows[settings] = self._judged(row)
        return self.rows[settings]

    def _judged(self, row: dict) -> dict:
        if "error" in row:
            return {**row, "fits": False}
        compiled = row["compiled"]
        state = compiled["params"] + compiled["opt_state"]
        row["state_fraction"] = state / (self.unsharded + self.unsharded_opt)
        row["peak"], row["peak_source"] = verdict_peak(row)
        if self.device_bytes is not None:
            row["margin"] = self.device_bytes - row["peak"]
            row["fits"] = row["margin"] >= 0
            row["tight"] = row["fits"] and row["margin"] < TIGHT * self.device_bytes
        return row

    def search(self, base: PlanSettings) -> list[dict]:
        """Candidates around ``base`` (module docstring), in the order they were tried."""
        dp, mp = self.layout.dp, self.layout.mp
        tried = []
        for _, settings in moves(base, dp, mp, self.named):
            tried.append(self.evaluate(settings))
            if not self.every_option and tried[-1] and tried[-1]["fits"] and not tried[-1]["tight"]:
                break  # the costlier options are not needed
        if not any(r and r["fits"] for r in tried):
            tried += self._stacked(base, dp, mp)
        return _unique(tried)

    def _stacked(self, base: PlanSettings, dp: int, mp: int) -> list[dict]:
        """The options applied one after another (the micro-batch halved as often as it takes)."""
        current, rows = base, []
        for option in STACK_ORDER:
            while (step := dict(moves(current, dp, mp, self.named)).get(option)) is not None:
                row = self.evaluate(step)
                if row is None:
                    return rows
                rows.append(row)
                if "error" in row:
                    break  # this option cannot be built here: go on without it
                current = step
                if row["fits"]:
                    return rows
                if option != "accum":
                    break
        return rows


def verdict_peak(row: dict) -> tuple[int, str]:
    """(bytes, what they are): the peak every verdict and the recommendation use. XLA:TPU's own heap
    where the chip's compiler planned the step (``compiler_peak``: what the chip holds; its refusal
    names the heap too): the plan's sum, argument + output + temp - alias, counts 0.5-2.7 GiB of
    temporaries the heap never holds at once at the real sizes (qwen3-0.6b selective batch 4: 18.40 GB
    summed, 14.87 GiB held, and it ran on the chip: docs/memory.md), while at tiny sizes the heap is
    the larger, by its tiles' padding. The host's plan corrected for the chip where there is a
    correction (an upper bound of the chip's sum); else the host compiler's sum."""
    compiled = row["compiled"]
    if "corrected" in row:
        return row["corrected"]["peak"], "host plan, corrected for the chip"
    if "compiler_peak" in compiled:
        return compiled["compiler_peak"], "the chip compiler's heap"
    return compiled["peak"], "argument + output + temp - alias"


def _unique(rows: list[dict | None]) -> list[dict]:
    seen, out = set(), []
    for row in rows:
        if row is not None and id(row) not in seen:
            seen.add(id(row))
            out.append(row)
    return out


def recommended(rows: list[dict], base: PlanSettings) -> dict | None:
    """The cheapest fitting row that is not tight (then the smallest peak), or None."""
    fitting = [r for r in rows if r.get("fits")]
    if not fitting:
        return None
    key = lambda r: (r["tight"], cost(PlanSettings(**r["settings"]), base), r["peak"])
    return min(fitting, key=key)


def plan(
    cfg: ModelConfig,
    name: str,
    where,
    settings: PlanSettings,
    *,
    device_bytes: int | None = None,
    max_compiles: int = DEFAULT_MAX_COMPILES,
    every_option: bool = False,
    target: Target | None = None,
) -> dict:
    """The planner's report (one JSON-able dict) on ``where`` (a Layout or a jax Mesh; the memory
    options are the settings'): the given settings, and the search if they don't fit. ``target``:
    the chip and compiler (``plan_target.resolve``; None: this host's, uncorrected), whose devices
    ``where``'s mesh is placed on."""
    target = target or resolve(None, "auto", 1)
    layout = target.place(Layout.of(where))
    settings.check(cfg, layout)
    planner = Planner(
        cfg=cfg,
        layout=layout,
        device_bytes=device_bytes,
        max_compiles=max(1, max_compiles),
        every_option=every_option,
        target=target,
        base_dtype=settings.base_dtype,
    )
    row = planner.evaluate(settings, strict=True)
    candidates = planner.search(settings) if row.get("fits") is False else []
    best = recommended([row, *candidates], settings)
    return {
        "config": name,
        "mesh": layout.shape,
        "backend": jax.default_backend(),  # this host's; the compile's: compiler["platform"]
        "compiler": target.describe(),
        "note": compiler_note(target),
        "analytic_note": ANALYTIC_NOTE,
        "unsharded": {
            "params": planner.unsharded,
            "opt_state": planner.unsharded_opt * MOMENT_SCALE[settings.opt_dtype],
            "base_dtype": planner.base_dtype,
        },
        "device_memory": device_bytes,
        "plan": row,
        "candidates": candidates,
        "recommended": best["label"] if best else None,
        "compiles": len(planner.rows),
        "max_compiles": planner.max_compiles,
        "pipeline": pipeline_facts(layout),
    }


def compiler_note(target: Target) -> str | None:
    """What the compiled figures are: the host CPU's plan (uncorrected: an estimate of an accelerator's;
    corrected: the chip's calibration), or None for the chip's own compiler's."""
    if target.correction is not None:
        return (
            f"compiled by XLA for host CPU devices; the verdicts use its temporaries corrected for "
            f"{target.chip.name} (the compiler line); the chip's own compiler plans it exactly: "
            "pip install -e '.[tpu-plan]'"
        )
    return CPU_NOTE if target.platform == "cpu" else None


def pipeline_facts(layout: Layout) -> dict | None:
    """With pp: the schedule and its ideal bubble, ticks, stashed micro-batch inputs and permutes."""
    if layout.pipeline is None:
        return None
    from meshlm.parallel.pipeline_schedule import schedule_facts

    facts = schedule_facts(layout.pipeline)
    return {
        **{k: getattr(layout, k) for k in ("pp", "microbatches", "pp_schedule", "virtual_stages")},
        **dataclasses.asdict(facts),
    }
