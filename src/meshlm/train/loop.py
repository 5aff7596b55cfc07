"""``meshlm train``: the training loop. Sharded step, periodic evaluation and checkpoints, exact resume.

State on disk (``--out DIR``): orbax checkpoints ``DIR/<step>/`` (params, optimizer state, and in the
meta the model and train configs and the data position), ``metrics.jsonl``, TensorBoard events and
``loss_curve.png``. The batch at step s is a function of (seed, s), so a checkpoint at step s plus the
same command continues bit for bit (on the same mesh). Building the run (configs, data, initial or
resumed state) is ``meshlm.train.run``.
"""

from __future__ import annotations

import functools
import math
import signal
import sys
import time
from pathlib import Path

from meshlm.data.device_batches import device_batch
from meshlm.data.tokenizer import bits_per_byte
from meshlm.errors import TrainingError
from meshlm.generate.generator import Generator
from meshlm.parallel import distributed
from meshlm.train.config import TrainConfig
from meshlm.train.metrics import plot_loss_curve
from meshlm.train.run import Run, build_run, checkpoint_meta


def evaluate(run: Run) -> dict:
    losses = [float(run.eval_fn(run.params, b)) for b in run.val]
    val_loss = sum(losses) / len(losses)
    bpb = bits_per_byte(val_loss, run.val_bytes_per_token)  # per byte of text, whatever the tokenizer
    return {"step": run.step, "val_loss": val_loss, "val_bpb": bpb}


def save(run: Run) -> None:
    """A checkpoint of the current step, once. The decision uses in-memory state, not the directory
    listing, so every process of a multi-process job takes the same branch of this collective save."""
    if run.saved_step == run.step:
        return
    state = {"params": run.params, "opt_state": run.opt_state}
    run.ckpt.save(run.step, state, checkpoint_meta(run.tcfg, run.cfg, run.step, run.mesh, run.tokenizer_meta))
    run.saved_step = run.step


class _Stop:
    """SIGINT/SIGTERM set a flag; the loop saves a checkpoint at the next step boundary and exits."""

    def __init__(self):
        self.signal = None  # set by the handler, in this process
        self.agreed = None  # the signal every process acts on
        self._old = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}

    def _handle(self, signum, frame):
        self.signal = signum

    def requested(self) -> bool:
        """Whether any process got a signal. Processes see a signal at different step boundaries,
        but the save is a collective: all must stop at the same step, so they agree first (one
        tiny collective per step; nothing in a single-process run)."""
        if self.agreed is None:
            self.agreed = distributed.max_over_processes(self.signal or 0) or None
        return self.agreed is not None

    def restore(self):
        for s, h in self._old.items():
            signal.signal(s, h)


def _train_row(run: Run, metrics: dict, seconds: float) -> dict:
    tokens = run.tcfg.batch_size * run.tcfg.seq_len
    lr = float(_lr(run.tcfg)(run.step - 1))
    return {
        "step": run.step,
        "loss": float(metrics["loss"]),
        "lr": lr,
        "grad_norm": float(metrics["grad_norm"]),
        "tokens_per_s": tokens / max(seconds, 1e-9),
    }


@functools.cache
def _lr(tcfg: TrainConfig):
    """The learning-rate schedule, built once per config (it is logged every step)."""
    from meshlm.train.optim import schedule

    return schedule(tcfg.optim())


def _one_step(run: Run) -> dict:
    batch = device_batch(run.batcher, run.step, run.mesh, run.tcfg.accum_steps)
    run.params, run.opt_state, metrics = run.step_fn(run.params, run.opt_state, batch)
    loss = float(metrics["loss"])  # waits for the step
    if not math.isfinite(loss) or not math.isfinite(float(metrics["grad_norm"])):
        save(run)  # the step left the state untouched: this is the last good state
        raise TrainingError(
            f"non-finite loss ({loss}) at step {run.step + 1}; the last good state (step "
            f"{run.step}) is saved in {run.ckpt.directory}. Lower --lr or check the data"
        )
    run.step += 1
    return metrics


def _progress(run: Run):
    from tqdm import tqdm

    return tqdm(
        total=run.tcfg.steps,
        initial=run.step,
        desc="train",
        unit="step",
        file=sys.stderr,
        disable=not distributed.is_main(),
        dynamic_ncols=True,
    )


def _loop(run: Run, stop: _Stop) -> None:
    tcfg = run.tcfg
    bar = _progress(run)
    try:
        while run.step < tcfg.steps and not stop.requested():
            t0 = time.perf_counter()
            metrics = _one_step(run)
            row = _train_row(run, metrics, time.perf_counter() - t0)
            if run.step % tcfg.log_every == 0 or run.step == tcfg.steps:
                run.log.write(row)
            bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_s']:,.0f}", refresh=False)
            bar.update(1)
            if tcfg.eval_every and run.step % tcfg.eval_every == 0 and run.step < tcfg.steps:
                _eval_and_log(run, bar)
            if tcfg.save_every and run.step % tcfg.save_every == 0:
                save(run)
    finally:
        bar.close()


def _eval_and_log(run: Run, bar=None) -> dict:
    row = evaluate(run)
    run.log.write(row)
    text = f"step {row['step']}: val_loss {row['val_loss']:.4f}  val_bpb {row['val_bpb']:.3f}"
    (bar.write if bar is not None and distributed.is_main() else lambda t: distributed.print0(t))(text)
    return row


def train(tcfg: TrainConfig, mesh) -> dict:
    """Train (or resume) per ``tcfg`` on ``mesh``; returns a summary dict."""
    run = build_run(tcfg, mesh)
    try:
        return _train(run)
    finally:
        run.release()  # the run directory's lock: another run may use it now


def _train(run: Run) -> dict:
    start_step, t0 = run.step, time.perf_counter()
    first = _eval_and_log(run) if run.step == 0 else None
    stop = _Stop()
    try:
        _loop(run, stop)
    finally:
        stop.restore()
    save(run)
    if stop.agreed is not None:
        name = signal.Signals(stop.agreed).name
        distributed.print0(
            f"{name}: saved a checkpoint at step {run.step} in {run.ckpt.directory}; "
            "run the same command to resume",
            file=sys.stderr,
        )
        return {"interrupted": name, "step": run.step}
    last = _eval_and_log(run)
    summary = {
        "step": run.step,
        "steps_run": run.step - start_step,
        "wall_s": time.perf_counter() - t0,
        "val_bpb_start": first["val_bpb"] if first else None,
        "val_bpb_end": last["val_bpb"],
        "out": str(run.ckpt.directory),
    }
    _finish(run, summary)
    return summary


def _finish(run: Run, summary: dict) -> None:
    """Loss curve, a generated sample, and the summary line (process 0 prints)."""
    run.log.close()
    if distributed.is_main():
        summary["loss_curve"] = str(plot_loss_curve(run.log.rows(), Path(run.tcfg.out)))
    if run.tcfg.sample_tokens:
        summary["sample"] = _sample(run)
    run.ckpt.close()


def _sample(run: Run) -> str:
    gen = Generator(run.cfg, run.params, run.mesh, tokenizer=run.tokenizer, eod=run.tokenizer.eod_id)
    n = min(run.tcfg.sample_tokens, run.cfg.max_seq_len - 8)
    result = gen.generate(["def "], max_new_tokens=n, temperature=0.8, top_k=40, seed=run.tcfg.seed)[0]
    return "def " + result.text
