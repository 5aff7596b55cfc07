"""``meshlm train``'s run with what perf adds on top of the training loop (``train.loop.train``): each
log step's per-device TFLOP/s and MFU on an accelerator (``perf.mfu``), and a device's out-of-memory as
one line naming what was asked and what fits (``perf.oom``). Here, not in ``train``: perf sits above
train (its bench and planner build train's steps), and the layering keeps each import one way."""

from __future__ import annotations

from meshlm.perf.mfu import utilisation
from meshlm.perf.oom import Asked, reported
from meshlm.train.config import TrainConfig
from meshlm.train.loop import train as train_loop


def train(tcfg: TrainConfig, where, stop=None) -> dict:
    """``train.loop.train`` with MFU terms and the out-of-memory line (no checkpoint is written on the
    way out of an out-of-memory: the loop's own rule)."""
    with reported(lambda: train_asked(tcfg, where)):
        return train_loop(tcfg, where, stop, utilisation=utilisation)


def train_asked(tcfg: TrainConfig, where) -> Asked:
    """The run as an out-of-memory line names it, with the flags of train that cut memory."""
    from meshlm.train.run import run_layout, run_model, step_config

    tcfg, cfg = run_model(tcfg)
    layout = run_layout(tcfg, where)
    cuts = ["--remat full"] if tcfg.remat != "full" else []
    cuts += [] if tcfg.fsdp else ["--fsdp (weights and AdamW state split over dp > 1)"]
    cuts += ["a smaller --batch-size (or --accum-steps N: the same batch in N micro-batches)"]
    cuts += ["--bf16 (16-bit activations)"] if tcfg.compute_dtype == "float32" else []
    cuts += ["--opt-dtype bf16 (AdamW moments in bfloat16)"] if tcfg.opt_dtype == "float32" else []
    return Asked(
        "train",
        tcfg.config or tcfg.checkpoint,
        step_config(tcfg, cfg),  # the step's model: its remat, attention and experts' dispatch
        layout,
        tcfg.batch_size,
        tcfg.seq_len,
        tuple(cuts),
        compute_dtype=tcfg.compute_dtype,
        opt_dtype=tcfg.opt_dtype,
        remat=tcfg.remat,
        accum_steps=tcfg.accum_steps,
        checkpoint=tcfg.checkpoint or None,
    )
