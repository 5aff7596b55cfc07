"""A device's out-of-memory as one line (``OutOfMemory``, exit 2) instead of the runtime's traceback:
what the command asked for, what fits, and the flags of that command that cut memory.

"What fits" is the memory planner's *analytic* estimate (``perf.plan.analytic``: parameters, gradients,
AdamW state and its copies, activations by Korthikanti et al.), from shapes alone: it takes a second on
the host, where ``meshlm plan``'s compiled figure would compile the step again (minutes for a model
that fills a chip, and on the device that just ran out). The line says so, and gives the ``meshlm
plan`` command that compiles and searches. Against the device's own memory limit (``memory_stats``'s
``bytes_limit``; a CPU reports none: then only the estimate is given) it names the largest batch that
fits at the asked sequence length, and with ``--remat full``.

Shapes in the estimate are one device's (per-shard), as ``meshlm plan`` reports them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from meshlm.errors import OutOfMemory, is_out_of_memory
from meshlm.model.config import ModelConfig
from meshlm.parallel.layout import Layout
from meshlm.units import format_bytes


@dataclass(frozen=True)
class Asked:
    """A run of train steps as a command asked for it: what the line names and the planner estimates.

    ``copies``: the model states held at once (bench: one per implementation; verify: the sharded and
    the unsharded model); ``scale``: the estimate's factor for wider values (verify --x64: 2);
    ``cuts``: this command's flags that cut memory, as the line lists them."""

    command: str
    config: str
    cfg: ModelConfig
    layout: Layout
    batch_size: int
    seq_len: int
    cuts: tuple[str, ...]
    compute_dtype: str = "float32"
    opt_dtype: str = "float32"  # AdamW's moments as stored (``--opt-dtype``)
    remat: str = "none"
    accum_steps: int = 1
    copies: int = 1
    scale: int = 1
    checkpoint: str | None = None  # the model is a checkpoint's (``config`` names it): plan reads that

    def plan_model(self) -> str:
        """The model as ``meshlm plan`` takes it: ``--config NAME`` or ``--checkpoint DIR``."""
        return f"--checkpoint {self.checkpoint}" if self.checkpoint else f"--config {self.config}"


@contextlib.contextmanager
def reported(describe: Callable[[], Asked | str]) -> Iterator[None]:
    """Within: a device's out-of-memory becomes ``OutOfMemory`` with ``describe()``'s line (an Asked
    is estimated, a string is the line); any other error passes unchanged."""
    try:
        yield
    except Exception as e:
        if not is_out_of_memory(e):
            raise
        asked = describe()
        raise OutOfMemory(asked if isinstance(asked, str) else out_of_memory_line(asked)) from None


def device_memory() -> tuple[str, int | None]:
    """(the first device's kind, its memory limit in bytes; None where it reports none, as a CPU)."""
    import jax

    device = jax.devices()[0]
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - a backend without memory statistics: no limit to state
        stats = {}
    return device.device_kind, stats.get("bytes_limit")


def out_of_memory_line(asked: Asked) -> str:
    """The line: what was asked, the planner's estimate and what fits, the flags, the plan command."""
    kind, limit = device_memory()
    where = kind + (f" ({format_bytes(limit)})" if limit else "")
    mesh = asked.layout.label()
    what = (
        f"{asked.config} on mesh {mesh}, batch {asked.batch_size} x seq {asked.seq_len}, "
        f"{asked.compute_dtype} compute, remat {asked.remat}"
    )
    memory = f" --device-memory {limit / 2**30:.1f}GiB" if limit else " --device-memory SIZE"
    plan = (
        f"`meshlm plan {asked.plan_model()} --mesh {asked.layout.dp}x{asked.layout.mp}{memory} "
        f"--batch-size {asked.batch_size} --seq-len {asked.seq_len}` compiles the step on the host and "
        "searches what fits"
    )
    return (
        f"out of memory on {where} in meshlm {asked.command}: asked {what}; {fits(asked, limit)}; "
        f"cut memory with {', '.join(asked.cuts)}; {plan}"
    )


@dataclass(frozen=True)
class Estimate:
    """The planner's analytic figures of ``asked`` (``perf.plan.analytic``, computed once): the bytes
    per device that do not depend on the batch or remat (the state ``copies`` times, gradients, XLA's
    moment copies, FSDP's gathered layer), and the activations at any batch and remat from the same
    formula (``perf.activations``: arithmetic, no shapes traced again)."""

    asked: Asked
    state: float  # parameters and AdamW moments, ``copies`` times
    fixed: float  # state + gradients + moment copies + gathered weights

    @classmethod
    def of(cls, asked: Asked) -> Estimate:
        from meshlm.perf.plan import analytic

        a = analytic(asked.cfg, asked.layout, _settings(asked, asked.batch_size, asked.remat))
        state = (a["params"] + a["opt_state"]) * asked.copies
        return cls(asked, state, state + a["gradients"] + a["moment_copies"] + a["gathered"])

    def peak(self, batch_size: int, remat: str) -> float:
        from meshlm.perf.activations import activation_bytes

        a, layout = self.asked, self.asked.layout
        settings = _settings(a, batch_size, remat)
        acts = activation_bytes(
            a.cfg,
            seq=a.seq_len,
            micro_batch=settings.micro_batch(layout.dp),
            mp=layout.mp,
            sp=layout.sp,
            remat=remat,
            act_bytes=2 if a.compute_dtype == "bfloat16" else 4,
            ep=layout.ep if layout.experts_split else 1,
        )
        return (self.fixed + acts["total"]) * a.scale


def _settings(asked: Asked, batch_size: int, remat: str):
    from meshlm.perf.plan_settings import PlanSettings

    return PlanSettings(
        batch_size=batch_size,
        seq_len=asked.seq_len,
        accum_steps=asked.accum_steps,
        compute_dtype=asked.compute_dtype,
        opt_dtype=asked.opt_dtype,
        fsdp=asked.layout.fsdp,
        sp=asked.layout.sp,
        remat=remat,
    )


def fits(asked: Asked, limit: int | None) -> str:
    """The estimate of what was asked and, against ``limit``, the largest batch that fits (with the
    asked remat, and with --remat full)."""
    est = Estimate.of(asked)
    peak, state = est.peak(asked.batch_size, asked.remat), est.state * asked.scale
    copies = f" ({asked.copies} models' state at once)" if asked.copies > 1 else ""
    text = (
        "the planner's analytic estimate (meshlm plan's, from shapes, not a compile) is "
        f"{format_bytes(peak)} per device, {format_bytes(state)} of it parameters and AdamW state{copies}"
    )
    if limit is None:
        return text + " (this device reports no memory limit to compare with)"
    if state >= limit:
        return text + f": the state alone exceeds {format_bytes(limit)}, no batch fits on this mesh"
    options = [(asked.remat, "")] + ([("full", " with --remat full")] if asked.remat != "full" else [])
    found = [f"batch {b}{label}" for remat, label in options if (b := largest_batch(est, limit, remat))]
    return text + (f"; fits: {' or '.join(found)}" if found else "; no batch fits at this sequence length")


def largest_batch(est: Estimate, limit: int, remat: str) -> int | None:
    """The largest batch up to the asked one, halving from it (in whole rows per data shard and
    micro-batch), whose estimate fits in ``limit``; None if even the smallest does not."""
    layout = est.asked.layout
    rows = layout.dp * est.asked.accum_steps * layout.pipeline_microbatches
    batch = est.asked.batch_size
    while batch >= rows:
        if est.peak(batch, remat) <= limit:
            return batch
        batch = batch // 2 // rows * rows
    return None
