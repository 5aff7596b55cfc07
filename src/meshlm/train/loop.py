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
from collections import deque
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshlm.data.device_batches import device_batch
from meshlm.data.tokenizer import ByteTokenizer, bits_per_byte
from meshlm.data.tokenizer_files import TOKENIZER_FILE
from meshlm.errors import MeshlmError, TrainingError, is_out_of_memory
from meshlm.generate.generator import Generator
from meshlm.parallel import distributed, watchdog
from meshlm.parallel.placement import put_global
from meshlm.sharding.stage_slots import slots_of, to_canonical
from meshlm.sharding.strategy import strategy
from meshlm.train import dpo_run
from meshlm.train.config import TrainConfig
from meshlm.train.explain import next_commands, start_line
from meshlm.train.metrics import compare_curves, plot_loss_curve
from meshlm.train.optim import trainable
from meshlm.train.routing import routing_row
from meshlm.train.run import Run, build_run, checkpoint_meta
from meshlm.train.stop import Stop

LAG = 1  # steps in flight beyond the one being read back (see _InFlight)


def evaluate(run: Run) -> dict:
    pending = [run.eval_fn(run.params, b) for b in run.val]  # all dispatched, then read
    if run.tcfg.objective == "dpo":  # (loss, reward metrics) per batch; no bits per byte
        return dpo_run.eval_row(run.step, pending)
    losses = [float(x) for x in pending]
    # each batch's loss is its own mean (a chat store's: over its masked targets): weighed by its count
    counts = [float(b["loss_mask"].sum()) if "loss_mask" in b else 1.0 for b in run.val]
    val_loss = sum(x * c for x, c in zip(losses, counts, strict=True)) / max(sum(counts), 1.0)
    bpb = bits_per_byte(val_loss, run.val_bytes_per_token)  # per byte of text, whatever the tokenizer
    return {"step": run.step, "val_loss": val_loss, "val_bpb": bpb}


def save(run: Run) -> None:
    """A checkpoint of the current step, once. The decision uses in-memory state, not the directory
    listing, so every process of a multi-process job takes the same branch of this collective save."""
    if run.saved_step == run.step:
        return
    # LoRA: the adapters alone (``optim.trainable``), their base named by its fingerprint in the meta
    state = {"params": trainable(run.cfg).select(run.params), "opt_state": run.opt_state}
    state = to_canonical(state, slots_of(run.cfg, run.layout))  # uneven pp stages: the real layers
    meta = checkpoint_meta(run.tcfg, run.cfg, run.step, run.layout, run.tokenizer_meta, run.lora_base)
    run.ckpt.save(run.step, state, meta)
    run.saved_step = run.step


def _train_row(run: Run, step: int, metrics: dict, seconds: float, mfu=None) -> dict:
    """Step ``step``'s metrics.jsonl row (reads its metrics: waits for that step, not later ones); on
    an accelerator (``mfu``, a ``perf.mfu.Utilisation``) also per-device TFLOP/s and MFU."""
    tokens = run.tcfg.batch_size * run.tcfg.seq_len
    row = {
        "step": step,
        "loss": float(metrics["loss"]),
        "lr": float(_lr(run.tcfg)[step - 1]),
        "grad_norm": float(metrics["grad_norm"]),
        "tokens_per_s": tokens / max(seconds, 1e-9),
        **(mfu.row(seconds) if mfu is not None else {}),
    }
    if "routing" in metrics:  # a mixture of experts: expert load, dropped choices (``train.routing``)
        row.update(routing_row(run.cfg, metrics["routing"]))
    if "mtp" in metrics:  # multi-token prediction: each depth's loss (``model.mtp``)
        row.update({f"mtp_loss_{d}": float(v) for d, v in enumerate(metrics["mtp"], start=1)})
    if "dpo" in metrics:  # DPO's reward accuracy, margins, chosen and rejected rewards (``train.dpo``)
        row.update({k: float(v) for k, v in metrics["dpo"].items()})
    return row


@functools.cache
def _lr(tcfg: TrainConfig) -> np.ndarray:
    """The learning rate of every step, computed once per config (it is logged every step; evaluating
    the schedule each time would dispatch a few tiny device computations per step)."""
    from meshlm.train.optim import schedule

    return np.asarray(jax.vmap(schedule(tcfg.optim()))(np.arange(tcfg.steps)))


def _healthy(run: Run):
    """A replicated device True: the first step's "previous step was finite" flag."""
    return put_global(np.array(True), NamedSharding(run.mesh, P()))


def _dispatch(run: Run, healthy) -> dict:
    """Start the next step (JAX dispatches asynchronously) and advance ``run.step``; its metrics stay
    on device. With ``healthy`` False (a previous step was non-finite) the step keeps the state."""
    batch = device_batch(run.batcher, run.step, run.layout, run.tcfg.accum_steps)
    run.params, run.opt_state, metrics = run.step_fn(run.params, run.opt_state, batch, healthy)
    run.step += 1
    return metrics


def _non_finite(run: Run, step: int, loss: float) -> TrainingError:
    """Step ``step`` was not finite, and left the state untouched, as did every step after it
    (``healthy``): the state is step ``step - 1``'s, the last good one. Save it; the error to raise."""
    run.step = step - 1
    save(run)
    return TrainingError(
        f"non-finite loss ({loss}) at step {step}; the last good state (step "
        f"{run.step}) is saved in {run.ckpt.directory}. Lower --lr or check the data"
    )


def _one_step(run: Run) -> dict:
    """One step, waited for (tests and tools; the loop keeps one step in flight instead)."""
    metrics = _dispatch(run, _healthy(run))
    loss = float(metrics["loss"])  # waits for the step
    if not bool(metrics["ok"]):
        raise _non_finite(run, run.step, loss)
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


class _InFlight:
    """Steps dispatched but not yet read back: at most ``LAG`` after each dispatch, so the host reads
    step s's metrics (and writes its row) while step s + 1 computes, and the device never waits for
    logging. Rows are written in step order; ``drain`` reads every step left (before an evaluation,
    a checkpoint, the end, or on the way out of a crash), so no row is lost."""

    def __init__(self, run: Run, bar, mfu=None):
        self.run, self.bar, self.mfu = run, bar, mfu
        self.steps: deque[tuple[int, dict]] = deque()  # (step, metrics on device)
        self.healthy = _healthy(run)  # the last dispatched step's metrics["ok"], on device
        self.clock = time.perf_counter()  # when the previous step was read back (or the loop began)

    def dispatch(self) -> None:
        metrics = _dispatch(self.run, self.healthy)
        self.healthy = metrics["ok"]
        self.steps.append((self.run.step, metrics))
        while len(self.steps) > LAG:
            self._read_one()

    def drain(self) -> None:
        while self.steps:
            self._read_one()

    def _read_one(self) -> None:
        run, tcfg = self.run, self.run.tcfg
        step, metrics = self.steps.popleft()
        with watchdog.program("the sharded train step", run.layout.label()), watchdog.waiting():
            metrics["loss"].block_until_ready()  # waits for step `step` only; later ones keep running
        now = time.perf_counter()
        row = _train_row(run, step, metrics, now - self.clock, self.mfu)
        self.clock = now
        if not (math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])):
            self.steps.clear()  # later steps kept the state (healthy was False): nothing to log
            raise _non_finite(run, step, row["loss"])
        if step % tcfg.log_every == 0 or step == tcfg.steps:
            run.log.write(row)
        shown = dict(loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_s']:,.0f}")
        if "mfu" in row:  # an accelerator's: per-device TFLOP/s and MFU
            shown |= dict(tflops=f"{row['tflops_per_device']:.1f}", mfu=f"{row['mfu']:.1%}")
        self.bar.set_postfix(**shown, refresh=False)
        self.bar.update(1)


def _loop(run: Run, stop: Stop, mfu=None) -> None:
    tcfg = run.tcfg
    bar = _progress(run)
    flight = _InFlight(run, bar, mfu)
    try:
        while run.step < tcfg.steps and not stop.requested():
            flight.dispatch()
            evals = tcfg.eval_every and run.step % tcfg.eval_every == 0 and run.step < tcfg.steps
            saves = tcfg.save_every and run.step % tcfg.save_every == 0
            if evals or saves or run.step == tcfg.steps:
                flight.drain()  # a checkpoint holds only steps known to be finite
            if evals:
                _eval_and_log(run, bar)
            if saves:
                save(run)
            if evals or saves:
                flight.clock = time.perf_counter()  # evaluations and checkpoints are not step time
        flight.drain()
    except TrainingError:
        raise
    except BaseException as e:
        if not is_out_of_memory(e):  # out of memory: the steps in flight failed with it, nothing to log
            _drain_quietly(flight)  # rows of the steps that finished before the crash
        raise
    finally:
        bar.close()


def _drain_quietly(flight: _InFlight) -> None:
    """On the way out of another error: log what can still be read, without masking that error. The
    state is not saved here (a crash is not a clean stop; the newest checkpoint is the resume point)."""
    try:
        flight.drain()
    except Exception as e:  # noqa: BLE001 - the original error is the one to report
        print(f"note: could not log the last steps ({type(e).__name__}: {e})", file=sys.stderr)


def _eval_and_log(run: Run, bar=None) -> dict:
    row = evaluate(run)
    run.log.write(row)
    extra = next((k for k in ("val_bpb", "val_reward_accuracy") if k in row), None)
    text = f"step {row['step']}: val_loss {row['val_loss']:.4f}  {extra} {row[extra]:.3f}"
    (bar.write if bar is not None and distributed.is_main() else lambda t: distributed.print0(t))(text)
    return row


def train(tcfg: TrainConfig, where, stop: Stop | None = None, utilisation=None) -> dict:
    """Train (or resume) per ``tcfg`` on ``where`` (a Layout or a jax Mesh; --fsdp and --sp are
    ``tcfg``'s); returns a summary dict. ``stop``: the signal flag (``meshlm.train.stop``) the caller
    installed earlier; by default one installed here, for the run. A signal during start-up raises
    ``Interrupted``; in the loop it saves and returns. ``utilisation``: (cfg, batch, seq, devices) ->
    the run's MFU terms or None (``perf.mfu.utilisation``: ``perf.train_run.train`` passes it, with the
    out-of-memory line around this; the layering keeps perf out of train)."""
    own = stop is None
    stop = stop or Stop()
    try:
        run = build_run(tcfg, where, startup_check=stop.check_startup)
        try:
            return _train(run, stop, utilisation)
        except BaseException as e:
            if isinstance(e, MeshlmError) or is_out_of_memory(e):
                run.undo_refused_start()  # refused before anything was saved: nothing left behind
            raise
        finally:
            run.release()  # the run directory's lock: another run may use it now
    finally:
        if own:
            stop.restore()


def _train(run: Run, stop: Stop, utilisation=None) -> dict:
    start_step, t0 = run.step, time.perf_counter()
    n_params = sum(int(p.size) for p in jax.tree.leaves(run.params))
    distributed.print0(start_line(run.tcfg, run.cfg, run.layout, n_params), file=sys.stderr)
    mfu = run_utilisation(run, utilisation)
    first = _eval_and_log(run) if run.step == 0 else None
    stop.check_startup()  # a signal during the first evaluation (or its compile): nothing ran yet
    _loop(run, stop, mfu)
    save(run)
    if stop.requested():  # also a signal during the last save: stop there, saved
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
        "val_bpb_start": first.get("val_bpb") if first else None,
        "val_bpb_end": last.get("val_bpb"),  # None for DPO: its validation row is its loss and rewards
        "val_loss_start": first["val_loss"] if first else None,
        "val_loss_end": last["val_loss"],
        "out": str(run.ckpt.directory),
    }
    _finish(run, summary)
    return summary


def run_utilisation(run: Run, utilisation=None):
    """The run's MFU terms on an accelerator (``perf.mfu``; its denominator said in one line), None on
    CPU, without ``utilisation`` and for DPO (whose step runs the policy on chosen and rejected rows:
    not the formula's batch)."""
    if run.tcfg.objective == "dpo" or utilisation is None:
        return None
    mfu = utilisation(run.cfg, run.tcfg.batch_size, run.tcfg.seq_len, run.layout.devices)
    if mfu is not None:
        distributed.print0(mfu.line(), file=sys.stderr)
    return mfu


def _finish(run: Run, summary: dict) -> None:
    """Loss curve, a generated sample, and the summary line (process 0 prints)."""
    run.log.close()
    byte_level = isinstance(run.tokenizer, ByteTokenizer)
    if distributed.is_main():
        unit = "nats/byte (byte tokens)" if byte_level else "nats/token"
        compare = compare_curves(run.tcfg.compare, run.tcfg.out)  # --compare: another run's beside
        summary["loss_curve"] = str(plot_loss_curve(run.log.rows(), Path(run.tcfg.out), unit, compare))
    saved_tokenizer = None if byte_level else str(Path(run.tcfg.out) / TOKENIZER_FILE)
    summary["next"] = next_commands(run.tcfg, run.layout, saved_tokenizer)
    if run.tcfg.sample_tokens and not strategy(run.layout).generates:  # e.g. no pipelined generation
        print0 = distributed.print0
        print0(
            "note: no sample under --pp; `meshlm generate` samples the checkpoint on any mesh",
            file=sys.stderr,
        )
    elif run.tcfg.sample_tokens:
        summary["sample"] = _sample(run)
    run.ckpt.close()


def _sample_params(run: Run):
    """The parameters the sample generates with, in one dtype: a LoRA base stored in bf16 with float32
    adapters (``--base-dtype``) computes as the step does, in bf16 under --bf16 (no float32 copy of the
    base), else in float32; a model of one dtype as it is."""
    from meshlm.sharding.spmd import compute_params
    from meshlm.train.step import COMPUTE_DTYPES

    if len({x.dtype for x in jax.tree.leaves(run.params)}) < 2:
        return run.params
    dtype = COMPUTE_DTYPES[run.tcfg.compute_dtype]
    if dtype is None:
        return compute_params(run.params)
    return jax.tree.map(lambda p: p.astype(dtype), run.params)


def _sample(run: Run) -> str:
    cfg = run.cfg.replace(**run.tcfg.dispatch_fields(jax.default_backend()))  # the step's
    gen = Generator(cfg, _sample_params(run), run.layout, tokenizer=run.tokenizer, eod=run.tokenizer.eod_id)
    n = min(run.tcfg.sample_tokens, run.cfg.max_seq_len - 8)
    result = gen.generate(["def "], max_new_tokens=n, temperature=0.8, top_k=40, seed=run.tcfg.seed)[0]
    return "def " + result.text
