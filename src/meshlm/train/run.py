"""Building a training run: the resolved configs, the data, the initial or resumed state, the jitted steps.

``build_run`` does everything that happens once before the loop (``meshlm.train.loop``) starts.
A run resumes from the newest checkpoint in ``--out`` when the settings that change the computation
(``resume_must_match``) are the ones it was saved with.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

from meshlm.data.corpus import load_splits
from meshlm.data.device_batches import eval_arrays
from meshlm.data.store import TokenStore, store_arg
from meshlm.data.stream import Batcher
from meshlm.data.tokenizer import ByteTokenizer, Tokenizer
from meshlm.data.tokenizer_files import COMPANIONS, TOKENIZER_FILE
from meshlm.data.tokens import check_token_range
from meshlm.errors import CheckpointError, MeshlmError, is_out_of_memory
from meshlm.io.checkpoint import Checkpointer
from meshlm.io.model_io import FORMAT, load_model, read_config
from meshlm.io.run_lock import RunLock, lock_run
from meshlm.model import lora
from meshlm.model.config import ModelConfig, default_seq_len, get_config
from meshlm.model.masked import loss_weights
from meshlm.model.transformer import param_shapes
from meshlm.parallel import distributed
from meshlm.parallel.layout import Layout
from meshlm.settings import toml_text
from meshlm.sharding.rules import model_specs, shardings
from meshlm.sharding.stage_slots import canonical_abstract, slots_of, to_device
from meshlm.sharding.strategy import strategy
from meshlm.train import dpo_run, outputs
from meshlm.train.config import TrainConfig, recorded_settings, resolve, with_moe_settings
from meshlm.train.lora import META_KEY as LORA_META
from meshlm.train.lora import (
    base_dtype,
    base_meta,
    check_needs_base,
    check_same_base,
    start_params,
    stored_base,
    with_lora,
)
from meshlm.train.metrics import OUTPUTS, SETTINGS, MetricsLog
from meshlm.train.optim import trainable
from meshlm.train.resume import check_existing, model_meta
from meshlm.train.step import COMPUTE_DTYPES, init_model, init_opt_state, sharded_step, step_model
from meshlm.train.tokenizers import run_tokenizer, tokenizer_meta

START_OUTPUTS = (*OUTPUTS, TOKENIZER_FILE, *COMPANIONS)  # what a refused start removes if it made them


@dataclass(kw_only=True)
class Run:
    """Everything the loop needs, built once. Mutable: the loop advances params, opt_state and step."""

    tcfg: TrainConfig  # resolved (see `resolve`): what the checkpoint meta records
    cfg: ModelConfig  # the model: --config's preset, or --checkpoint's own
    layout: Layout  # dp x mp devices and the memory options (fsdp, sp: the run's --fsdp, --sp)
    specs: dict  # parameter PartitionSpecs
    params: dict  # current parameters, sharded per specs
    opt_state: Any  # current optimizer state, sharded like params
    step: int  # optimizer steps completed
    step_fn: Callable  # (params, opt_state, batch) -> (params, opt_state, metrics), jitted and sharded
    eval_fn: Callable  # (params, batch) -> mean loss, jitted and sharded
    batcher: Batcher  # training batches: a pure function of (seed, step)
    val: list  # validation batches, already on the mesh
    ckpt: Checkpointer  # the run directory's checkpoints
    log: MetricsLog  # metrics.jsonl and TensorBoard
    saved_step: int = -1  # newest step this run saved or resumed from (same on every process)
    lock: RunLock | None = None  # held on process 0 until the loop ends (see `release`)
    tokenizer: Tokenizer = dataclasses.field(default_factory=ByteTokenizer)  # the data's tokenizer
    tokenizer_meta: dict | None = None  # its checkpoint meta entry (``train.tokenizers``)
    val_bytes_per_token: float = 1.0  # UTF-8 bytes per validation target: val_bpb's denominator
    out_before: frozenset[str] | None = None  # the run directory's entries before this start
    lora_base: dict | None = None  # LoRA: the base's fingerprint and path (``train.lora``), in every meta

    def undo_refused_start(self) -> None:
        """A start refused before it saved (e.g. while compiling): its outputs removed, the lock
        released (``outputs.undo_refused_start``); only if nothing was saved or resumed."""
        if self.saved_step == -1 and self.step == 0:
            self.log.close()
            outputs.undo_refused_start(self.ckpt.directory, self.out_before, START_OUTPUTS, self.release)

    @property
    def mesh(self):
        return self.layout.mesh

    def release(self) -> None:
        """Let another run use the directory."""
        if self.lock is not None:
            self.lock.release()


def _load_data(tcfg: TrainConfig, cfg: ModelConfig, layout: Layout, tok: Tokenizer, store: TokenStore | None):
    if store is not None:  # memory-mapped; its ids are the tokenizer's, never scanned here
        train, val, info = store.splits(tok, cfg.vocab_size)
    else:
        train, val, info = load_splits(list(tcfg.data) or None, tokenizer=tok, text_field=tcfg.text_field)
        check_token_range(train.tokens, cfg.vocab_size, "training data")
        check_token_range(val.tokens, cfg.vocab_size, "validation data")
    layout.check_batch(tcfg.batch_size, tcfg.accum_steps)
    batcher = Batcher(train, tcfg.seq_len, tcfg.batch_size, tcfg.seed)
    val_batches = Batcher(val, tcfg.seq_len, tcfg.micro_batch, tcfg.seed).eval_batches(tcfg.eval_batches)
    # a chat store's validation counts the targets it trains on (its loss mask), as its loss does
    masks = [b.get("loss_mask", np.ones(b["targets"].shape, np.uint8)) for b in val_batches]
    targets = max(sum(int(m.sum()) for m in masks), 1)
    info["val_bytes_per_token"] = (
        sum(int((tok.token_bytes[b["targets"]] * m).sum()) for b, m in zip(val_batches, masks, strict=True))
        / targets
    )
    return batcher, val_batches, info


def checkpoint_meta(
    tcfg: TrainConfig,
    cfg: ModelConfig,
    step: int,
    layout: Layout,
    tokenizer: dict | None = None,
    lora_base: dict | None = None,
) -> dict:
    """The meta saved with every checkpoint; ``resume.check_resumable`` reads its ``train_config`` back.
    ``tokenizer``: the entry ``tokenizer_meta`` returned (default: bytes). ``layout`` is recorded
    (``Layout.to_dict``); checkpoints saved before it have only ``mesh`` and load the same."""
    return {
        "tokenizer": tokenizer or {"kind": "bytes"},
        "format": FORMAT,
        "model_config": cfg.to_dict(),
        "train_config": tcfg.to_dict(),
        "data": {"next_step": step, "seed": tcfg.seed},
        "mesh": layout.shape,
        "layout": layout.to_dict(),
        "process_count": jax.process_count(),
        **(lora_base or {}),  # a LoRA run's base: its fingerprint and path (``train.lora.base_meta``)
    }


def _initial_state(tcfg: TrainConfig, cfg: ModelConfig, layout: Layout, specs: dict, ckpt: Checkpointer):
    """(params, opt_state, step, step_fn): resumed from ``ckpt``'s newest checkpoint, else fresh
    (initialised, or loaded from ``tcfg.checkpoint``) at step 0; sharded per ``specs`` (``run_specs``)."""
    meta = check_existing(tcfg, ckpt)
    part, expect, base_print = trainable(cfg), {"format": FORMAT, "model_config": model_meta(meta, cfg)}, None
    if tcfg.checkpoint:  # its model is the run's (``run_model``); with LoRA, the base of the adapters
        _, params, _ = load_model(tcfg.checkpoint, layout)
        params = jax.device_put(params, shardings(lora.base(specs), layout.mesh))  # onto FSDP slices
        if cfg.lora_rank:  # checkpoints hold the adapters alone: their base must be this one
            base_print = base_meta(tcfg, params)
            check_same_base(meta, base_print, tcfg)
            expect[LORA_META] = base_print[LORA_META]
            params = start_params(cfg, layout, specs, params, tcfg.seed)
            params = stored_base(params, base_dtype(tcfg))  # --base-dtype bf16: the frozen base halved
    else:
        params, _ = init_model(cfg, layout, tcfg.seed, specs=specs)
    dtype, dpo = COMPUTE_DTYPES[tcfg.compute_dtype], dpo_run.dpo_args(tcfg)
    step_fn, opt = sharded_step(
        step_config(tcfg, cfg), tcfg.optim(), layout, specs, params, dtype, dpo, tcfg.seed
    )
    opt_state = init_opt_state(opt, part.select(params), part.select(specs), layout.mesh)
    step = 0
    target = {"params": part.select(params), "opt_state": opt_state}
    # resume() also moves aside newer step directories it could not use, which would block saves.
    slots = slots_of(cfg, layout)  # uneven pp stages: checkpoints hold the real layers (``stage_slots``)
    resumed = ckpt.resume(canonical_abstract(target, slots), expect_meta=expect)
    if resumed:
        state, _, step = resumed
        state = to_device(state, slots)
        params, opt_state = part.put(params, state["params"]), state["opt_state"]
        distributed.print0(f"resuming from {ckpt.step_dir(step)} (step {step})", file=sys.stderr)
    else:  # never silent: a --out that names another directory than meant starts a new run there
        start = f" from the parameters of --checkpoint {tcfg.checkpoint}" if tcfg.checkpoint else ""
        distributed.print0(
            f"starting a fresh run in {ckpt.directory.resolve()}{start} (no checkpoint there to resume)",
            file=sys.stderr,
        )
    return params, opt_state, step, step_fn, base_print


def run_model(tcfg: TrainConfig) -> tuple[TrainConfig, ModelConfig]:
    """(the resolved settings, the run's model): ``--config``'s preset, or under ``--checkpoint`` the
    checkpoint's own model (a converted one matches no preset), which ``--config``, if given, must
    name. The run's ``--doc-mask`` (not the checkpoint's) decides document masking."""
    check_needs_base(tcfg)
    if not tcfg.checkpoint:
        return resolve(tcfg)
    model, meta = read_config(tcfg.checkpoint)
    if model.lora_rank:  # its adapters' base is elsewhere: a run continues in its own --out
        raise CheckpointError(
            f"--checkpoint {tcfg.checkpoint} holds LoRA adapters; merge them into their base first "
            "(meshlm convert --merge) or resume that run with its own --out"
        )
    model = model.replace(doc_mask=-1)
    if tcfg.config and meta.get("train_config", {}).get("config") != tcfg.config:  # not trained from it
        _check_same_model(tcfg, get_config(tcfg.config), model)
    return resolve(tcfg, model)


def _check_same_model(tcfg: TrainConfig, preset: ModelConfig, model: ModelConfig) -> None:
    diffs = [
        f"{f.name} {getattr(preset, f.name)!r} vs {getattr(model, f.name)!r}"
        for f in dataclasses.fields(ModelConfig)
        if f.name not in ("doc_mask", "quant") and getattr(preset, f.name) != getattr(model, f.name)
    ]
    if diffs:
        raise CheckpointError(
            f"--config {tcfg.config} is not the model of --checkpoint {tcfg.checkpoint} "
            f"({'; '.join(diffs)}: preset vs checkpoint); leave out --config to train the checkpoint's "
            "own model"
        )


def run_layout(tcfg: TrainConfig, where) -> Layout:
    """The run's Layout: ``where`` itself when it is a Layout with the run's mesh options (the CLI's,
    built once from the same flags), else ``where`` (a Layout, or a jax Mesh) with the run's --fsdp,
    --sp, --pp (and its schedule) and --cp (``MeshFlags.layout_options``)."""
    options = tcfg.layout_options()
    if isinstance(where, Layout) and all(getattr(where, k) == v for k, v in options.items()):
        return where
    return Layout.of(where, **options)


def run_specs(tcfg: TrainConfig, cfg: ModelConfig, layout: Layout) -> dict:
    """The parameter specs of this run (with ``--fsdp``, weights split over dp); a dimension the mesh
    cannot split, or (``--sp``) a sequence mp cannot split, is a one-line error before any work."""
    layout.check_seq_len(tcfg.seq_len)
    strategy(layout).check(cfg, layout)
    return model_specs(cfg, param_shapes(cfg), layout)


def step_config(tcfg: TrainConfig, cfg: ModelConfig) -> ModelConfig:
    """The model the jitted programs compute: the preset with the run's ``--remat``, ``--unroll``,
    ``--attention``, ``--moe-dispatch`` and ``--loss-chunk``. They change memory or speed, never values,
    so checkpoints keep the preset's config (Run.cfg, compared on resume) and a run resumes under any."""
    step = step_model(cfg, remat=tcfg.remat, unroll=tcfg.unroll, fsdp=tcfg.fsdp)
    backend = jax.default_backend()  # "auto": flash on a TPU where it applies; ragged_dot on TPU/GPU
    seq_len = default_seq_len(cfg, tcfg.seq_len)  # resolved already in a run; 0 is the default's
    attention, dispatch = tcfg.attention_kind(backend, seq_len), tcfg.dispatch_fields(backend)
    chunk = tcfg.loss_chunk  # the head's loss in chunks (``model.chunked_xent``): memory, not values
    return step.replace(attention=attention, attn_block=tcfg.attn_block, loss_chunk=chunk, **dispatch)


def build_run(tcfg: TrainConfig, where, startup_check: Callable[[], None] = lambda: None) -> Run:
    """Resolve ``tcfg``, load the data, and initialise or resume the state on ``where`` (a Layout or
    a jax Mesh; the run's --fsdp and --sp are ``tcfg``'s). ``startup_check`` is called after the data
    and after the state (``Stop.check_startup``)."""
    tcfg, cfg = run_model(tcfg)
    cfg = with_lora(tcfg, with_moe_settings(tcfg, cfg))
    cfg = cfg.replace(quant=tcfg.quant)  # in the saved config: eval and generate quantize as it trained
    layout = run_layout(tcfg, where)
    dpo = tcfg.objective == "dpo"  # --data: pairs (``train.dpo_run``)
    store = None if dpo else store_arg(tcfg.data, tcfg.tokenizer)  # --data DIR: a token store or None
    specs = run_specs(tcfg, cfg, layout)  # bad --fsdp / --sp combinations fail before the data is read
    if tcfg.fsdp and layout.dp == 1:
        distributed.print0(
            "note: --fsdp on a mesh with dp=1 saves no memory (it splits weights and AdamW state over "
            "dp, here 1 device); use a mesh with dp > 1, e.g. --mesh 2x2",
            file=sys.stderr,
        )
    tok, cfg = run_tokenizer(tcfg, cfg)
    if tcfg.doc_mask:  # recorded in the checkpoint's model config: eval and verify --checkpoint apply it
        cfg = cfg.replace(doc_mask=tok.eod_id)
    out = Path(tcfg.out)
    if dpo:
        batcher, val, line = dpo_run.load_pairs(tcfg, cfg, layout, tok)
        info = {"val_bytes_per_token": 0.0}  # no bits per byte: DPO's validation is its own loss
    else:
        batcher, val, info = _load_data(tcfg, cfg, layout, tok, store)
        line = (
            f"data: {info['source']}; train {info['train_bytes']:,} bytes in {info['train_files']} "
            f"files, validation {info['val_bytes']:,} bytes in {info['val_files']}; {info['tokenizer']}"
            + (f"; {info['skipped']}" if info.get("skipped") else "")
        )
    distributed.print0(line, file=sys.stderr)
    startup_check()
    before = outputs.entries(out)  # what a refused start leaves as it was
    lock = lock_run(out)  # before anything in `out` is read or written; creates it
    try:
        run = _build(tcfg, cfg, layout, specs, out, batcher, val, lock)
        run.tokenizer, run.tokenizer_meta = tok, tokenizer_meta(out, tok)
        run.val_bytes_per_token, run.out_before = info["val_bytes_per_token"], before
        _write_settings(out, tcfg, layout)
        startup_check()
        return run
    except BaseException as e:
        if isinstance(e, MeshlmError) or is_out_of_memory(e):  # refused: nothing left behind
            outputs.undo_refused_start(out, before, START_OUTPUTS, lock.release if lock else lambda: None)
        elif lock is not None:
            lock.release()
        raise


def _write_settings(out: Path, tcfg: TrainConfig, layout: Layout) -> None:
    """settings.toml: the run's resolved settings, rewritten at each start once resuming is allowed
    (``meshlm train --settings out/settings.toml`` runs it again). --devices only where it counts:
    fake CPU devices of one process."""
    if distributed.is_main():
        one_cpu = jax.process_count() == 1 and jax.default_backend() == "cpu"
        values = recorded_settings(tcfg, f"{layout.dp}x{layout.mp}", layout.devices if one_cpu else None)
        comment = "meshlm train's resolved settings: `meshlm train --settings FILE` runs it again"
        outputs.replace_text(out / SETTINGS, toml_text(values, comment + " (flags given override the file)"))


def _eval_loss(cfg: ModelConfig, layout: Layout, specs, dtype):
    """The validation loss: sharded (``shard_map``), or under pp the plain model partitioned by XLA; of a
    chat store's batch, the masked loss Σ(mask · loss) / Σ mask (``loop.evaluate`` weighs the batches
    by their mask counts)."""
    loss = strategy(layout).loss(cfg, layout, specs, dtype)
    return lambda params, batch: loss(params, loss_weights(batch))


def _build(tcfg: TrainConfig, cfg: ModelConfig, layout: Layout, specs, out: Path, batcher, val, lock) -> Run:
    """The state and outputs in ``out``, which this run has locked."""
    ckpt = Checkpointer(out, keep=tcfg.keep)
    params, opt_state, step, step_fn, base_print = _initial_state(tcfg, cfg, layout, specs, ckpt)
    log = MetricsLog(out, enabled=distributed.is_main())
    if step == 0:
        log.set_aside_earlier()  # rows without a checkpoint: an earlier run's, never rewritten
    else:
        log.truncate_after(step, redo_eval=step >= tcfg.steps)
    dtype = COMPUTE_DTYPES[tcfg.compute_dtype]
    eval_fn = jax.jit(_eval_loss(step_config(tcfg, cfg), layout, specs, dtype))
    if tcfg.objective == "dpo":  # the reference's log-probs (computed or read back), DPO's validation
        val, eval_fn = dpo_run.validation(
            tcfg, step_config(tcfg, cfg), layout, specs, params, step, batcher, val
        )
    return Run(
        tcfg=tcfg,
        cfg=cfg,
        layout=layout,
        specs=specs,
        params=params,
        opt_state=opt_state,
        step=step,
        step_fn=step_fn,
        eval_fn=eval_fn,
        batcher=batcher,
        val=eval_arrays(val, layout),
        ckpt=ckpt,
        log=log,
        saved_step=step if step else -1,
        lock=lock,
        lora_base=base_print,
    )
