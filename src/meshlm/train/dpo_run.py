"""``meshlm train --objective dpo``: the run's pairs, its reference log-probs (computed once, cached in
the run directory), its validation and its metrics rows.

The reference's per-target log-probs of every row (train and validation) are computed before the first
step from the starting weights (``--checkpoint``'s, or the initialisation) by the policy's own sharded
program (``train.dpo.per_token_logps``, float32), and written to ``--out/dpo_reference.npy`` with a
sidecar ``dpo_reference.json`` (the rows' SHA-256 and count). A resumed run reads them back bit for bit
(the starting weights are gone by then); a resumed run without them, or with rows that changed, is one
clear error. The starting weights themselves are not kept: no second copy of the model in memory.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import jax
import numpy as np

from meshlm.data.pair_store import is_pair_store, load_pair_store
from meshlm.data.pairs import PairBatcher, encode_pairs, read_pairs, renderer_for
from meshlm.errors import CheckpointError, ConfigError
from meshlm.parallel import distributed
from meshlm.parallel.placement import batch_sharding, put_global, to_host

CACHE, CACHE_META = "dpo_reference.npy", "dpo_reference.json"


def dpo_args(tcfg) -> tuple[float, str] | None:
    """(beta, loss) of a DPO run; None for the language-model objective."""
    return (tcfg.dpo_beta, tcfg.dpo_loss) if tcfg.objective == "dpo" else None


def load_pairs(tcfg, cfg, layout, tok):
    """(batcher, validation row indices, info) of the run's pairs (``data.pairs``)."""
    from meshlm.train.dpo import check_dpo

    check_dpo(cfg.replace(loss_chunk=tcfg.loss_chunk))  # the step's loss, as ``run.step_config`` sets it
    if not tcfg.data:
        raise ConfigError(
            "--objective dpo needs --data: JSONL or Parquet files of (prompt, chosen, rejected)"
        )
    if len(tcfg.data) == 1 and is_pair_store(tcfg.data[0]):  # ``data prepare --pairs``
        train, val, index = load_pair_store(tcfg.data[0], tok, tcfg.seq_len)
        dropped, rule = index["dropped"], index["rule"]
    else:
        render = renderer_for(tok)  # the run's tokenizer's own template, checked as it was read
        train, val, dropped = encode_pairs(read_pairs(tcfg.data), render, tcfg.seq_len, tok.eod_id)
        rule = render.rule
    for rows, name in ((train, "training"), (val, "validation")):
        if int(rows.tokens.max()) >= cfg.vocab_size:
            raise ConfigError(f"the {name} pairs have ids >= the model's vocabulary {cfg.vocab_size}")
    layout.check_batch(tcfg.batch_size, tcfg.accum_steps)
    batcher = PairBatcher(train, tcfg.batch_size, tcfg.seed, tcfg.accum_steps)
    val_batcher = PairBatcher(val, tcfg.batch_size, tcfg.seed)
    line = (
        f"data: {train.pairs} training and {val.pairs} validation pairs ({dropped} dropped: longer than "
        f"--seq-len {tcfg.seq_len}); rendered as {rule}"
    )
    return batcher, val_batcher, line


def attach_reference(out: Path, batcher: PairBatcher, val: PairBatcher, logps_fn, params, layout, step: int):
    """Fill both batchers' ``ref`` from the cache in ``out``, or (a fresh run) compute and cache it."""
    rows = [batcher.data, val.data]
    digest = hashlib.sha256(b"".join(r.tokens.tobytes() + r.mask.tobytes() for r in rows)).hexdigest()
    meta = {"rows": [len(r.tokens) for r in rows], "sha256": digest}
    path, meta_path = out / CACHE, out / CACHE_META
    if path.is_file() and meta_path.is_file() and json.loads(meta_path.read_text()) == meta:
        ref = np.load(path)
    elif step:
        raise CheckpointError(
            f"{out} resumes a DPO run but its reference log-probs ({CACHE}) are missing or for other "
            "pairs; run with the --data it started with, or start a new --out"
        )
    else:
        distributed.print0("DPO: computing the reference's log-probs of every pair (once)", file=sys.stderr)
        ref = _compute(rows, batcher.global_batch, logps_fn, params, layout)
        if distributed.is_main():
            np.save(path, ref)
            meta_path.write_text(json.dumps(meta) + "\n")
    batcher.ref, val.ref = ref[: meta["rows"][0]], ref[meta["rows"][0] :]


def _compute(rows, batch: int, logps_fn, params, layout) -> np.ndarray:
    """[rows, T] float32: every row's per-target log-probs, ``batch`` rows at a time (the last chunk
    filled with row 0, dropped after)."""
    fn, sharding = jax.jit(logps_fn), batch_sharding(layout, 1)
    out = []
    for data in rows:
        n = len(data.tokens)
        for start in range(0, n, batch):
            index = np.arange(start, start + batch)
            index[index >= n] = 0
            host = data.rows(index, None)
            tokens = {k: put_global(host[k], sharding) for k in ("inputs", "targets")}
            out.append(np.asarray(to_host(fn(params, tokens)), np.float32)[: n - start])
    return np.concatenate(out)


def val_batches(val: PairBatcher, count: int) -> list[dict]:
    return [val.data.rows(index, val.ref) for index in val.eval_batches(count)]


def eval_fn(value):
    """fn(params, batch) -> (loss, metrics): ``train.dpo.dpo_value`` without dL/ds and the sums."""
    return jax.jit(lambda params, batch: value(params, batch)[:2])


def eval_row(step: int, results: list) -> dict:
    """The validation row: the loss and reward metrics, means over the batches."""
    mean = lambda xs: sum(float(x) for x in xs) / len(xs)
    row = {"step": step, "val_loss": mean([loss for loss, _ in results])}
    row.update({f"val_{k}": mean([m[k] for _, m in results]) for k in results[0][1]})
    return row


def validation(tcfg, cfg, layout, specs, params, step: int, batcher: PairBatcher, val: PairBatcher):
    """(validation batches, eval_fn) of a DPO run, once its reference log-probs are attached."""
    from meshlm.train.dpo import dpo_value, per_token_logps

    logps = per_token_logps(cfg.replace(z_loss=0.0), layout, specs)
    attach_reference(Path(tcfg.out), batcher, val, logps, params, layout, step)
    return val_batches(val, tcfg.eval_batches), eval_fn(dpo_value(logps, tcfg.dpo_beta, tcfg.dpo_loss))
