"""meshlm verify: prove the sharded model equals the unsharded one, parameter by parameter."""

from __future__ import annotations

import dataclasses
import json
import sys
from functools import partial

from meshlm.cli.common import add_common, add_flags, flag_layout, settings_from, setup
from meshlm.cli.verify_settings import VerifySettings
from meshlm.data.tokenizer import EOD
from meshlm.errors import ConfigError, ShardingError
from meshlm.model.config import beyond_max_seq_len, default_seq_len, get_config
from meshlm.parallel.axes import PP
from meshlm.settings import LongContext
from meshlm.train.lora import check_early

DATA_STEPS = 3  # steps of the data-pipeline check (cheap: host arrays only)
DPO_ACCUM = 2  # accumulation micro-batches of DPO's proof steps (``proof.runs.default_optim``'s)


def add_parser(sub) -> None:
    p = sub.add_parser("verify", help="prove sharded == unsharded for every parameter")
    add_common(p, VerifySettings.config)  # also --config and --seed (fields marked CLI_COMMON)
    add_flags(p, VerifySettings)
    p.set_defaults(fn=run)


def run(args) -> int:
    from meshlm.errors import VERIFIER_EXIT_CODE, VerifierError

    vs = _with_defaults(settings_from(args, VerifySettings))
    if vs.allow_routing_flips and vs.x64:  # before any work
        raise ConfigError("--allow-routing-flips is for float32 (in float64 a flip is a bug); drop one")
    if vs.attention == "flash" and vs.x64:  # before any work (``model.flash``: float32 inside the kernel)
        raise ConfigError("--attention flash computes in float32 inside its kernel; verify it without --x64")
    axes = _axes(vs)  # before any work
    _check_base_dtype(vs)  # before any work
    check_early(vs, vs.checkpoint or "", vs.config)  # e.g. --lora-rank above its targets' widths
    if vs.objective == "dpo":  # before any work: what DPO's training refuses
        _check_dpo(vs)
    if planned := flag_layout(args, vs):  # before any work
        if vs.batch_size is not None:
            planned.check_batch(vs.batch_size, DPO_ACCUM if vs.objective == "dpo" and vs.steps else None)
        if vs.seq_len is not None or vs.checkpoint is None:  # else the checkpoint's model decides
            planned.check_seq_len(_shapes(vs, get_config(vs.config), planned)[0])
        if vs.checkpoint is None:
            from meshlm.sharding.rules import check_uniform_stack  # imports JAX: here

            check_uniform_stack(get_config(vs.config), planned)
    try:
        return _matrix(args, vs, axes) if vs.matrix else _verify(args, vs, planned)
    except VerifierError as e:
        print(f"meshlm: verifier error: {e}", file=sys.stderr)
        return VERIFIER_EXIT_CODE


def _check_dpo(vs: VerifySettings) -> None:
    """DPO's proof refuses what its training refuses, in the same lines (``train.dpo.check_dpo``,
    ``data.pairs``): a model or flag DPO does not train, a --batch-size of half a pair; with --steps
    (training's step with ``DPO_ACCUM`` micro-batches of whole pairs) one they cannot split."""
    from meshlm.data.pairs import check_pair_batch
    from meshlm.train.dpo import check_dpo

    cfg = _with_lora(vs, _model_config(vs)).replace(loss_chunk=vs.loss_chunk)
    check_dpo(cfg.replace(doc_mask=EOD) if vs.doc_mask and cfg.doc_mask < 0 else cfg)
    if vs.batch_size is None:
        return
    check_pair_batch(vs.batch_size)
    if vs.steps and vs.batch_size % (2 * DPO_ACCUM):
        raise ConfigError(
            f"--objective dpo with --steps: the proof's steps accumulate {DPO_ACCUM} micro-batches (as "
            f"--accum-steps {DPO_ACCUM}), each of whole pairs, so --batch-size {vs.batch_size} must be a "
            f"multiple of 2 x {DPO_ACCUM}"
        )


def _with_defaults(vs: VerifySettings) -> VerifySettings:
    """--microbatches and --virtual-stages: the flags, else ``proof.defaults``' exposing choices (the
    Layout's options then come from ``MeshFlags.layout_options`` as for every command)."""
    from meshlm.proof import defaults

    m = vs.microbatches if vs.microbatches is not None or not vs.on(PP) else defaults.microbatches(vs.pp)
    v = vs.virtual_stages
    if v is None:
        interleaved = vs.pp_schedule == "interleaved"
        v = defaults.virtual_stages(vs.pp, _model_config(vs)) if interleaved else 1
    return dataclasses.replace(vs, microbatches=m, virtual_stages=v)


def _model_config(vs: VerifySettings):
    if vs.checkpoint:
        from meshlm.io.model_io import read_config

        return read_config(vs.checkpoint)[0]
    return get_config(vs.config)


def _shapes(vs: VerifySettings, cfg, layout) -> tuple[int, int]:
    """(sequence length, attention block): the flags, else ``proof.defaults``' exposing choices where
    the blockwise kernel runs (--attention blockwise, or a --cp ring); for a model with a sliding
    window, blocks that meet the window's edge (``_window_shapes``)."""
    seq_len = _seq_len(vs, cfg)
    if not (vs.attention == "blockwise" or layout.cp_ring):
        return seq_len, vs.attn_block or LongContext.attn_block  # unused: no blockwise kernel runs
    from meshlm.proof import defaults

    if vs.attn_block is None:
        windowed = _window_shapes(vs, cfg, layout, seq_len) if 0 < cfg.sliding_window < seq_len else None
        return windowed or (seq_len, defaults.block_for(seq_len // layout.cp))
    if vs.seq_len is None:
        seq_len = defaults.ragged_seq_len(seq_len, vs.attn_block, layout.cp, partial(_fits, layout))
    return seq_len, vs.attn_block


def _window_shapes(vs: VerifySettings, cfg, layout, seq_len: int) -> tuple[int, int] | None:
    """A windowed model's (sequence length, block): ``proof.defaults.window_shapes``, its blocks meeting
    the window's edge where this layout's kernel cuts them (so the block-skip control runs)."""
    from meshlm.proof import defaults

    meets = partial(defaults.window_edge_met, window=cfg.sliding_window, layout=layout)
    lengths = [seq_len] if vs.seq_len else defaults.seq_lens(seq_len, layout.cp, partial(_fits, layout))
    return defaults.window_shapes(lengths, layout.cp, meets)


def _fits(layout, seq_len: int) -> bool:
    try:
        layout.check_seq_len(seq_len)
    except ShardingError:
        return False
    return True


def _seq_len(vs: VerifySettings, cfg) -> int:
    """--seq-len (above the model's max_seq_len only for rotary models: ``beyond_max_seq_len``), or the
    default rule."""
    seq_len = default_seq_len(cfg, vs.seq_len or 0)
    try:
        beyond_max_seq_len(cfg, seq_len)
    except ConfigError:
        return cfg.max_seq_len
    return seq_len


def _axes(vs: VerifySettings) -> tuple[str, ...]:
    if vs.axes and not vs.matrix:
        raise ConfigError(f"--axes {vs.axes} picks --matrix's extra cells; add --matrix or drop --axes")
    from meshlm.proof.axes_matrix import parse_axes

    return parse_axes(vs.axes)


def _matrix(args, vs: VerifySettings, axes: tuple[str, ...]) -> int:
    import os
    import tempfile

    # Before JAX starts (setup): see meshlm.proof.matrix for why these are safe and worth it.
    fast = " --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + fast
    setup(args)
    import jax

    if not jax.config.jax_compilation_cache_dir:  # a cache for this run only, removed at exit
        cache = tempfile.TemporaryDirectory(prefix="meshlm-verify-matrix-")
        jax.config.update("jax_compilation_cache_dir", cache.name)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

    from meshlm.parallel.distributed import print0
    from meshlm.proof.matrix import format_matrix, run_matrix

    if vs.x64:
        jax.config.update("jax_enable_x64", True)
    rows = run_matrix(jax.device_count(), x64=vs.x64, steps=vs.steps, seed=vs.seed, axes=axes)
    print0(json.dumps(rows) if args.json else format_matrix(rows, markdown=vs.md))
    return 0 if all(r["ok"] in (True, None) for r in rows) else 1


def _verify(args, vs: VerifySettings, planned) -> int:
    layout = setup(args, vs, planned, model=lambda: _model_config(vs))
    import jax

    from meshlm.parallel.distributed import print0
    from meshlm.sharding.strategy import strategy

    if vs.x64:
        jax.config.update("jax_enable_x64", True)
    cfg, name, eod = get_config(vs.config), vs.config, EOD
    if vs.checkpoint:
        from meshlm.io.model_io import read_config

        cfg, name = read_config(vs.checkpoint)[0], vs.checkpoint
        if (tok_eod := _check_tokenizer(vs.checkpoint, print0)) is not None:
            eod = tok_eod
    if vs.doc_mask and cfg.doc_mask < 0:  # a checkpoint trained with --doc-mask has it already
        cfg = cfg.replace(doc_mask=eod)
    if vs.z_loss is not None:
        cfg = cfg.replace(z_loss=vs.z_loss)
    if vs.remat is not None:
        cfg = cfg.replace(remat=vs.remat)
    if vs.quant is not None:
        cfg = cfg.replace(quant=vs.quant)
    if cfg.quant == "int8" and not vs.x64:  # the flag's or a checkpoint's (docs/quantization.md)
        raise ConfigError(
            "--quant int8 is proven in float64: in float32 the two runs' rounding moves values across "
            "quantization boundaries (3e-3 relative on the seed model, above the 2e-4 tolerance); add --x64"
        )
    if vs.moe_aux_loss is not None:  # a dense model refuses it (ModelConfig: a MoE field)
        cfg = cfg.replace(moe_aux_loss=vs.moe_aux_loss)
    if vs.moe_capacity_factor is not None:  # likewise
        cfg = cfg.replace(moe_capacity_factor=vs.moe_capacity_factor)
    cfg = _with_lora(vs, cfg)
    from meshlm.proof import defaults

    seq_len, block = _shapes(vs, cfg, layout)
    backend = jax.default_backend()  # "auto": flash on a TPU where it applies; ragged_dot on TPU and GPU
    attention, dispatch = vs.attention_kind(backend, seq_len, vs.x64), vs.dispatch_fields(backend)
    # what the controls see
    cfg = cfg.replace(attention=attention, attn_block=block, loss_chunk=vs.loss_chunk, **dispatch)
    batch = (
        vs.batch_size
        if vs.batch_size is not None
        else defaults.batch_rows(layout.dp, layout.pipeline_microbatches)
    )
    if vs.objective == "dpo" and vs.batch_size is None:  # rows: a pair per data shard (a micro-batch's)
        batch *= 2 * (DPO_ACCUM if vs.steps else 1)
    layout.check_seq_len(seq_len)
    kernel = f", blocks of {block}" if cfg.attention == "blockwise" or layout.blockwise else ""
    kernel += f", the loss in chunks of {cfg.loss_chunk} tokens" if cfg.loss_chunk else ""
    print0(f"shapes: batch {batch} x {seq_len} tokens{kernel}", file=sys.stderr)
    strategy(layout).check(cfg, layout)  # e.g. layers a pipeline cannot split
    from meshlm.perf.oom import reported

    # a device's out-of-memory, compiling or stepping: one line (``perf.oom``)
    with reported(lambda: verify_asked(vs, cfg, name, layout, batch, seq_len)):
        return _prove(args, vs, cfg, name, layout, batch, seq_len)


def verify_asked(vs: VerifySettings, cfg, name: str, layout, batch: int, seq_len: int):
    """The proof as an out-of-memory line names it: it holds the sharded model and the unsharded
    reference (``copies``), in float64 with --x64 (twice the bytes)."""
    from meshlm.perf.oom import Asked

    remat = cfg.remat if isinstance(cfg.remat, str) else ("full" if cfg.remat else "none")
    cuts = ["a smaller --batch-size", "a smaller --seq-len"]
    cuts += ["--remat full"] if remat != "full" else []
    cuts += [] if layout.fsdp else ["--fsdp (weights and AdamW state split over dp > 1)"]
    return Asked(
        "verify",
        name,
        cfg,
        layout,
        batch,
        seq_len,
        tuple(cuts),
        compute_dtype="float64" if vs.x64 else "float32",
        remat=remat,
        copies=2,
        scale=2 if vs.x64 else 1,
        checkpoint=vs.checkpoint,
    )


def _prove(args, vs: VerifySettings, cfg, name: str, layout, batch: int, seq_len: int) -> int:
    """The proof of ``cfg`` on ``layout``: DPO's, or the model's with its controls; the exit code."""
    import jax.numpy as jnp

    from meshlm.io.model_io import load_model
    from meshlm.parallel.distributed import print0
    from meshlm.proof import format_report, model_problem, verify

    if vs.objective == "dpo":  # DPO's step: its own program, reference and controls (``proof.dpo``)
        from meshlm.proof.dpo import prove_dpo

        dtype = jnp.float64 if vs.x64 else jnp.float32
        load = (lambda m: load_model(vs.checkpoint, m)[1]) if vs.checkpoint else None  # the policy's
        report = prove_dpo(
            cfg,
            name,
            layout,
            batch,
            seq_len,
            vs.seed,
            loss=vs.dpo_loss,
            dtype=dtype,
            load_params=load,
            steps=vs.steps,
            opt_dtype=vs.opt_dtype,
        )
        print0(json.dumps(report.to_json()) if args.json else format_report(report))
        return 0 if report.ok else 1
    problem = model_problem(cfg, name, layout, batch, seq_len, vs.seed)
    problem = dataclasses.replace(problem, opt_dtype=vs.opt_dtype)  # the training steps' moments
    if vs.checkpoint:
        problem = dataclasses.replace(problem, load_params=lambda m: load_model(vs.checkpoint, m)[1])
    from meshlm.proof.controls import CONTROLS
    from meshlm.proof.cp_controls import CP_CONTROLS
    from meshlm.proof.ep_controls import EP_CONTROLS
    from meshlm.proof.lora import LORA_CONTROLS, for_lora, lora_problem
    from meshlm.proof.quant_controls import QUANT_CONTROLS
    from meshlm.train.lora import base_dtype

    controls = CONTROLS + CP_CONTROLS + EP_CONTROLS + QUANT_CONTROLS
    if vs.objective == "sft":  # the chat SFT loss: a loss mask on the batch, and its controls
        from meshlm.proof.sft import SFT_CONTROLS, sft_problem

        problem = sft_problem(problem)
        controls += SFT_CONTROLS
    if cfg.lora_rank:  # adapters: random A and B, the LoRA rows and controls (``proof.lora``)
        problem, controls = lora_problem(problem, base_dtype(vs)), for_lora(controls) + LORA_CONTROLS
    controls = {"controls": controls}
    dtype = jnp.float64 if vs.x64 else jnp.float32
    report = verify(
        problem,
        layout,
        steps=vs.steps,
        dtype=dtype,
        seed=vs.seed,
        collectives=vs.collectives,
        data_steps=DATA_STEPS,
        allow_routing_flips=vs.allow_routing_flips,
        **controls,
    )
    print0(json.dumps(report.to_json()) if args.json else format_report(report))
    return 0 if report.ok else 1


def _check_base_dtype(vs: VerifySettings) -> None:
    """--base-dtype bf16 is proven on the model's random parameters (``proof.lora.lora_problem``): a
    checkpoint's, DPO's and the matrix's parameters are read in the proof's dtype, so it is refused
    there in one line, not dropped."""
    if vs.base_dtype != "bf16":
        return
    other = "--checkpoint" if vs.checkpoint else "--objective dpo" if vs.objective == "dpo" else ""
    other = other or ("--matrix" if vs.matrix else "")
    if other:
        raise ConfigError(
            f"--base-dtype bf16 is proven on the model's random parameters, not with {other}; drop one"
        )


def _with_lora(vs, cfg):
    """``cfg`` with ``--lora-rank``'s adapters; alpha defaults to 2R here, so that the proof's scale
    is not 1 (a scale applied twice would be the same number)."""
    from meshlm.train.lora import with_lora

    if not vs.lora_rank:
        return with_lora(vs, cfg)  # (--lora-dropout alone: one line)
    return with_lora(dataclasses.replace(vs, lora_alpha=vs.lora_alpha or 2.0 * vs.lora_rank), cfg)


def _check_tokenizer(checkpoint: str, print0) -> int | None:
    """The checkpoint's tokenizer must load, match its SHA-256 and fit the model's vocabulary;
    returns its EOD id (None: the checkpoint has no tokenizer)."""
    import sys

    from meshlm.train.tokenizers import checkpoint_tokenizer

    tok = checkpoint_tokenizer(checkpoint, required=False)
    print0(f"tokenizer: {tok.describe() if tok else 'none (token ids only)'}", file=sys.stderr)
    return tok.eod_id if tok else None
