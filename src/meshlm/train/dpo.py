"""DPO's step on a mesh: the loss of ``model.preference`` and its exact gradient, through the model's
own sharded programs.

The loss is a function of each row's completion log-prob sum s_j; its gradient is
Σ_j (dL/ds_j) ∇s_j = ∇ [mean over the step's N targets of w_t · CE_t] with the constant per-target
weights w_t = -N · dL/ds_j(t) · m_t (CE = -log p, m the completion mask). So a step is:

1. the policy's per-target log-probs (``per_token_logps``: the model in one ``shard_map`` -- dp, mp, cp,
   fsdp, sp -- or under pp the plain model partitioned by XLA), summed over the completions on the
   global [B] rows: pairs (rows 2i, 2i + 1) meet there, so a pair may sit across data shards or
   pipeline micro-batches and is still one pair;
2. the loss, its reward metrics, and dL/ds by autodiff of the formula (``dpo_loss``) on those sums;
3. the model's own weighted-loss gradient (the SFT path: ``model.masked``'s ``weights``) with those w:
   the layout's strategy (one ``shard_map``, or the pipeline's schedule with its micro-batches).

Two forwards and one backward per step (the policy's sums, then the gradient pass). The reference's
per-target log-probs are an input (``ref_logps`` [B, T]): computed once before training by the seam
``reference_logps`` (full fine-tuning: the starting weights, frozen) and cached (``train.dpo_run``).
``meshlm verify --objective dpo`` (``proof.dpo``) proves sums, loss and gradients equal to the
unsharded autodiff of the formula. The policy's sums are taken in the master dtype (float32), the
gradient pass in the run's compute dtype.
"""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp
from jax import lax

from meshlm.errors import ConfigError
from meshlm.model import preference
from meshlm.model.layers import mask_vocab_padding, vocab_parallel_xent
from meshlm.model.masked import WEIGHTS
from meshlm.model.transformer import local_logits
from meshlm.parallel.context import Parallel
from meshlm.parallel.cp import sequence_order
from meshlm.parallel.layout import Layout
from meshlm.parallel.placement import batch_spec
from meshlm.sharding.spmd import with_compute_dtype
from meshlm.sharding.strategy import strategy


def check_dpo(cfg) -> None:
    """What DPO does not run, as one line before any work."""
    if cfg.lora_dropout:
        raise ConfigError(
            "--objective dpo compares the policy's log-probs with the reference's, so it trains without "
            "dropout (as trl's disable_dropout); drop --lora-dropout"
        )
    if cfg.arch.moe:
        raise ConfigError(
            "--objective dpo trains dense models: a mixture of experts' router losses and load balancing "
            "are not part of DPO's gradient pass yet; use a dense model, or --objective lm for this one"
        )
    if cfg.loss_chunk:
        raise ConfigError(
            "--objective dpo sums its own log-probabilities from whole logits; --loss-chunk chunks the "
            "language-model loss only: leave it out"
        )
    if cfg.doc_mask >= 0:
        raise ConfigError(
            "--objective dpo holds one prompt and completion per row (nothing packed): a document mask "
            "has nothing to separate; leave out --doc-mask"
        )


def _per_token(cfg, par: Parallel):
    def fn(batch):  # with cp: this shard's chunks [B, T/cp]
        logits, _ = local_logits(cfg, par, par.seq_local(batch["inputs"]))
        logits = mask_vocab_padding(par, par.seq_out(logits), cfg.vocab_size)
        return -vocab_parallel_xent(par, logits, par.seq_local(batch["targets"]))

    # in the widest of the parameters' dtypes (a LoRA base stored in bf16: its adapters' float32)
    return with_compute_dtype(hk.without_apply_rng(hk.transform(fn)).apply, None)


def per_token_logps(cfg, layout: Layout | None, specs=None):
    """fn(params, batch) -> log p(target) global [B, T] (no z-loss). ``layout`` None: the unsharded
    model (the proof's reference); under pp the plain model partitioned by XLA (``Pipelined.loss``)."""
    # the layout's strategy runs the whole model in one shard_map where it generates (not under pp)
    if layout is None or not strategy(layout).generates:
        return _per_token(cfg, Parallel())
    apply = _per_token(cfg, Parallel.on(layout))
    # Each shard's [B/dp, T/cp] (with cp its two load-balanced chunks) is a block of the global
    # [B, T], put back in sequence order outside the shard_map.
    out = layout.spec("batch", "length")
    sharded = jax.shard_map(apply, mesh=layout.mesh, in_specs=(specs, batch_spec(layout)), out_specs=out)

    def fn(params, batch):
        tokens = {k: batch[k] for k in ("inputs", "targets")}
        return sequence_order(sharded(params, tokens), layout.cp)

    return fn


def reference_logps(logps_fn, reference_params):
    """The seam: batch -> the reference's per-target log-probs [B, T]. Full fine-tuning: the policy's
    program on the frozen starting weights (with LoRA: the base with its adapters off)."""
    return lambda batch: logps_fn(reference_params, batch)


def completion_mask(batch):
    """The batch's completion mask [B, T] (the proof plants an off-by-one here: ``proof.dpo``)."""
    return batch[preference.COMPLETION_MASK]


def dpo_value(logps_fn, beta: float, loss: str):
    """fn(params, batch) -> (loss, metrics, dL/ds [B], the policy's row sums s [B]) of the step's
    pairs (no gradient pass)."""

    def fn(params, batch):
        mask = completion_mask(batch)
        policy = preference.sequence_logps(logps_fn(params, batch), mask)
        reference = preference.sequence_logps(batch[preference.REF_LOGPS].astype(policy.dtype), mask)
        lengths = jnp.sum(mask, axis=-1)
        value, coeff = jax.value_and_grad(lambda s: preference.dpo_loss(s, reference, lengths, beta, loss))(
            policy
        )
        return value, preference.dpo_metrics(policy, reference, beta), coeff, policy

    return fn


def dpo_value_and_grad(
    cfg, layout: Layout, specs, *, beta: float, loss: str, compute_dtype=None, sums=False, accum=1, **kw
):
    """fn(params, batch) -> ((loss, metrics), grads): ``batch`` {"inputs", "targets",
    "completion_mask", "ref_logps"} global [B, T], rows in pairs. ``sums``: metrics also "sums", the
    policy's row sums [B] (the proof's). ``accum``: fn is one of A micro-batches of whole pairs (equal
    counts), whose losses and gradients ``optim.accumulate`` averages -- Σ over the step's pairs / their
    number, exactly -- and whose metrics it sums: they come out as 1/A of this micro-batch's means.
    ``kw``: the strategy's (the proof's ``par_cls``, ``pipe_cls``, ``fill``)."""
    cfg = cfg.replace(z_loss=0.0)  # the gradient pass's token loss is -log p exactly
    value = dpo_value(per_token_logps(cfg, layout, specs), beta, loss)
    grad = strategy(layout).value_and_grad(cfg, layout, specs, compute_dtype=compute_dtype, **kw)

    def fn(params, batch):
        loss_value, metrics, coeff, policy = value(params, batch)
        mask = completion_mask(batch).astype(coeff.dtype)
        weights = lax.stop_gradient(-mask.size * coeff[:, None] * mask)  # mean(w · CE) has L's gradient
        _, grads = grad(params, {"inputs": batch["inputs"], "targets": batch["targets"], WEIGHTS: weights})
        metrics = {k: m / accum for k, m in metrics.items()}  # summed over the A micro-batches
        return (loss_value, {**metrics, "sums": policy} if sums else metrics), grads

    return fn
