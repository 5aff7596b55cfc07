"""``meshlm train``: the training loop. Sharded step, periodic evaluation and checkpoints, exact resume.

State on disk (``--out DIR``): orbax checkpoints ``DIR/<step>/`` (params, optimizer state, and in the
meta the model and train configs and the data position), ``metrics.jsonl``, TensorBoard events and
``loss_curve.png``. The batch at step s is a function of (seed, s), so a checkpoint at step s plus the
same command continues bit for bit (on the same mesh).
"""

from __future__ import annotations

import functools
import math
import signal
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import jax

from meshlm.data.corpus import Batcher, bits_per_byte, load_splits
from meshlm.data.device_batches import device_batch, eval_arrays
from meshlm.data.tokens import check_token_range
from meshlm.errors import CheckpointError, ConfigError, TrainingError
from meshlm.io.checkpoint import Checkpointer
from meshlm.io.model_io import FORMAT, abstract_params, load_model
from meshlm.model.config import ModelConfig, get_config
from meshlm.model.transformer import loss_fn
from meshlm.parallel import distributed
from meshlm.parallel.axes import DP, MP
from meshlm.parallel.rules import model_specs
from meshlm.parallel.spmd import sharded_loss
from meshlm.train.config import TrainConfig
from meshlm.train.metrics import MetricsLog, plot_loss_curve
from meshlm.train.step import COMPUTE_DTYPES, init_model, init_opt_state, sharded_step

# Train-config fields that change the computation: a resumed run must use the same values.
RESUME_MUST_MATCH = (
    "config",
    "data",
    "batch_size",
    "seq_len",
    "lr",
    "warmup_steps",
    "weight_decay",
    "clip_norm",
    "accum_steps",
    "compute_dtype",
    "seed",
)


@dataclass
class Run:
    """Everything the loop needs, built once."""

    tcfg: TrainConfig
    cfg: ModelConfig
    mesh: object
    specs: dict
    params: dict
    opt_state: object
    step: int  # optimizer steps completed
    step_fn: object
    eval_fn: object
    batcher: Batcher
    val: list
    ckpt: Checkpointer
    log: MetricsLog
    saved_step: int = -1  # newest step this run saved or resumed from (same on every process)


def model_config(tcfg: TrainConfig) -> ModelConfig:
    cfg = get_config(tcfg.config)
    if tcfg.seq_len > cfg.max_seq_len:
        raise ConfigError(
            f"seq_len={tcfg.seq_len} exceeds the {tcfg.config} config's max_seq_len="
            f"{cfg.max_seq_len}; use --seq-len {cfg.max_seq_len} or less"
        )
    return cfg


def _load_data(tcfg: TrainConfig, cfg: ModelConfig, dp: int):
    train, val, info = load_splits(list(tcfg.data) or None)
    check_token_range(train.tokens, cfg.vocab_size, "training data")
    check_token_range(val.tokens, cfg.vocab_size, "validation data")
    if tcfg.micro_batch % dp:
        raise ConfigError(
            f"batch_size/accum_steps={tcfg.micro_batch} is not divisible by dp={dp}; "
            f"use a batch size that is a multiple of {dp * tcfg.accum_steps}"
        )
    batcher = Batcher(train, tcfg.seq_len, tcfg.batch_size, tcfg.seed)
    val_batches = Batcher(val, tcfg.seq_len, tcfg.micro_batch, tcfg.seed).eval_batches(tcfg.eval_batches)
    return batcher, val_batches, info


def _meta(tcfg: TrainConfig, cfg: ModelConfig, step: int, mesh) -> dict:
    return {
        "format": FORMAT,
        "model_config": cfg.to_dict(),
        "train_config": tcfg.to_dict(),
        "data": {"next_step": step, "seed": tcfg.seed},
        "mesh": dict(mesh.shape),
        "process_count": jax.process_count(),
    }


def _check_resumable(meta: dict, tcfg: TrainConfig, where: Path) -> None:
    saved = meta.get("train_config", {})
    diffs = [
        f"{k}: saved {saved.get(k)!r}, now {tcfg.to_dict()[k]!r}"
        for k in RESUME_MUST_MATCH
        if k in saved and saved[k] != tcfg.to_dict()[k]
    ]
    if diffs:
        raise CheckpointError(
            f"cannot resume from {where}: its run used different settings ({'; '.join(diffs)});"
            " pass the same flags, or a new --out to start another run"
        )


def _initial_state(tcfg: TrainConfig, cfg: ModelConfig, mesh, ckpt: Checkpointer):
    """(params, opt_state, step, specs, opt): resumed from ``ckpt``'s newest checkpoint, else fresh."""
    if ckpt.all_steps():
        if tcfg.fresh:
            raise CheckpointError(
                f"--fresh: {ckpt.directory} already holds checkpoints (steps "
                f"{ckpt.all_steps()}); choose a new --out or delete them yourself"
            )
        with warnings.catch_warnings():  # restore() below warns about interrupted saves once
            warnings.simplefilter("ignore")
            meta = ckpt.read_meta()
        _check_resumable(meta, tcfg, ckpt.directory)
    specs = model_specs(cfg, abstract_params(cfg, mesh), mesh.shape[MP])
    if tcfg.checkpoint:
        loaded_cfg, params, _ = load_model(tcfg.checkpoint, mesh)
        if loaded_cfg != cfg:
            raise CheckpointError(
                f"--checkpoint {tcfg.checkpoint} holds a different model than --config "
                f"{tcfg.config}; pass the config it was made with"
            )
    else:
        params, specs = init_model(cfg, mesh, tcfg.seed)
    step_fn, opt = sharded_step(cfg, tcfg.optim(), mesh, specs, params, COMPUTE_DTYPES[tcfg.compute_dtype])
    opt_state = init_opt_state(opt, params, specs, mesh)
    step = 0
    if ckpt.all_steps():
        target = {"params": params, "opt_state": opt_state}
        state, meta, step = ckpt.restore(
            jax.tree.map(_abstract, target), expect_meta={"format": FORMAT, "model_config": cfg.to_dict()}
        )
        params, opt_state = state["params"], state["opt_state"]
        distributed.print0(f"resuming from {ckpt.step_dir(step)} (step {step})", file=sys.stderr)
    return params, opt_state, step, specs, step_fn


def _abstract(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


def build_run(tcfg: TrainConfig, mesh) -> Run:
    cfg = model_config(tcfg)
    out = Path(tcfg.out)
    batcher, val, info = _load_data(tcfg, cfg, mesh.shape[DP])
    distributed.print0(
        f"data: {info['source']}; train {info['train_bytes']:,} bytes in {info['train_files']} "
        f"files, validation {info['val_bytes']:,} bytes in {info['val_files']}",
        file=sys.stderr,
    )
    ckpt = Checkpointer(out, keep=tcfg.keep)
    params, opt_state, step, specs, step_fn = _initial_state(tcfg, cfg, mesh, ckpt)
    if distributed.is_main():
        out.mkdir(parents=True, exist_ok=True)
    log = MetricsLog(out, enabled=distributed.is_main())
    log.truncate_after(step, redo_eval=step == 0 or step >= tcfg.steps)
    dtype = COMPUTE_DTYPES[tcfg.compute_dtype]
    eval_fn = jax.jit(sharded_loss(lambda par: loss_fn(cfg, par), mesh, specs, dtype))
    return Run(
        tcfg,
        cfg,
        mesh,
        specs,
        params,
        opt_state,
        step,
        step_fn,
        eval_fn,
        batcher,
        eval_arrays(val, mesh),
        ckpt,
        log,
        saved_step=step if step else -1,
    )


def evaluate(run: Run) -> dict:
    losses = [float(run.eval_fn(run.params, b)) for b in run.val]
    val_loss = sum(losses) / len(losses)
    return {"step": run.step, "val_loss": val_loss, "val_bpb": bits_per_byte(val_loss)}


def save(run: Run) -> None:
    """A checkpoint of the current step, once. The decision uses in-memory state, not the directory
    listing, so every process of a multi-process job takes the same branch of this collective save."""
    if run.saved_step == run.step:
        return
    state = {"params": run.params, "opt_state": run.opt_state}
    run.ckpt.save(run.step, state, _meta(run.tcfg, run.cfg, run.step, run.mesh))
    run.saved_step = run.step


class _Stop:
    """SIGINT/SIGTERM set a flag; the loop saves a checkpoint at the next step boundary and exits."""

    def __init__(self):
        self.signal = None
        self._old = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}

    def _handle(self, signum, frame):
        self.signal = signum

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
        while run.step < tcfg.steps and stop.signal is None:
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
    start_step, t0 = run.step, time.perf_counter()
    first = _eval_and_log(run) if run.step == 0 else None
    stop = _Stop()
    try:
        _loop(run, stop)
    finally:
        stop.restore()
    save(run)
    if stop.signal is not None:
        name = signal.Signals(stop.signal).name
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


def _sample(run: Run) -> str | None:
    try:
        from meshlm.generate.generator import Generator
    except ImportError:
        return None
    gen = Generator(run.cfg, run.params, run.mesh)
    n = min(run.tcfg.sample_tokens, run.cfg.max_seq_len - 8)
    result = gen.generate(["def "], max_new_tokens=n, temperature=0.8, top_k=40, seed=run.tcfg.seed)[0]
    return "def " + result.text
