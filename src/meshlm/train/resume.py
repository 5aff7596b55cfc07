"""Resuming a run: what an existing ``--out`` must agree with before its newest checkpoint is loaded.

A run resumes when the settings that change the computation (``resume_must_match``) are the ones it
was saved with; ``--fresh`` refuses a directory that holds anything of a previous run.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

from meshlm.errors import CheckpointError, ConfigError
from meshlm.io.checkpoint import Checkpointer
from meshlm.model.config import ModelConfig, from_dict
from meshlm.parallel import distributed
from meshlm.train.config import TrainConfig, resume_must_match
from meshlm.train.metrics import OUTPUTS


def check_resumable(meta: dict, tcfg: TrainConfig, where: Path) -> None:
    saved, now = meta.get("train_config", {}), tcfg.to_dict()
    saved = {"opt_dtype": "float32", **saved}  # runs from before --opt-dtype stored float32 moments
    if saved.get("checkpoint") and not tcfg.checkpoint:  # else its preset is compared: a misleading diff
        raise CheckpointError(
            f"cannot resume from {where}: its run fine-tunes the model of --checkpoint "
            f"{saved['checkpoint']}; pass --checkpoint {saved['checkpoint']} again (with the same flags)"
        )
    # Under --checkpoint the model is the checkpoint's, compared whole on resume (model_config):
    # whether --config named it too changes nothing.
    names = [k for k in resume_must_match() if not (k == "config" and tcfg.checkpoint)]
    diffs = [
        f"{k}: saved {saved.get(k)!r}, now {now[k]!r}" for k in names if k in saved and saved[k] != now[k]
    ]
    if diffs:
        raise CheckpointError(
            f"cannot resume from {where}: its run used different settings ({'; '.join(diffs)});"
            " pass the same flags, or a new --out to start another run"
        )
    if "steps" in saved and saved["steps"] != now["steps"]:  # allowed, but never silent
        step = meta.get("data", {}).get("next_step", "?")
        distributed.print0(
            f"note: --steps {now['steps']} differs from the {saved['steps']} the run in {where} was "
            f"started with: the learning-rate schedule (warm-up, cosine decay to the last step) is "
            f"re-derived for {now['steps']} steps, so the rate changes from step {step} on",
            file=sys.stderr,
        )


def _check_fresh(ckpt: Checkpointer) -> None:
    """--fresh starts over: refuse a directory holding anything of a previous run, which the
    new run would mix its rows into or overwrite."""
    steps = ckpt.all_steps()
    found = [f"checkpoints (steps {steps})"] if steps else []
    found += [name for name in OUTPUTS if (ckpt.directory / name).exists()]
    if found:
        raise CheckpointError(
            f"--fresh: {ckpt.directory} already holds {', '.join(found)} of a previous run; "
            "choose a new --out or delete them yourself"
        )


def check_existing(tcfg: TrainConfig, ckpt: Checkpointer) -> dict | None:
    """Checks before resuming from ``ckpt``'s checkpoints, if it holds any (cheap: meta only);
    returns the newest checkpoint's meta (None without checkpoints)."""
    if tcfg.fresh:
        _check_fresh(ckpt)
    if not ckpt.all_steps():
        return None
    with warnings.catch_warnings():  # resume() reports interrupted and corrupt steps later, once
        warnings.simplefilter("ignore")
        meta = ckpt.read_meta()
    check_resumable(meta, tcfg, ckpt.directory)
    return meta


def model_meta(meta: dict | None, cfg: ModelConfig) -> dict:
    """The model config a resumed checkpoint must hold, as it was saved: an older spelling of the
    same config (e.g. ``remat: false`` before remat had policies) is the same model."""
    saved = (meta or {}).get("model_config")
    try:
        same = isinstance(saved, dict) and from_dict(saved) == cfg
    except ConfigError:
        same = False
    return saved if same else cfg.to_dict()
