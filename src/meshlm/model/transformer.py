"""The model: one Haiku forward for every family, run unsharded or inside ``shard_map`` unchanged.

Families (``ModelConfig.family``; their facts: ``model.family``) differ in their blocks (``BLOCKS``):
  ff          the prototype: residual feed-forward blocks (ff).
  parallel    norm; attention and MLP in parallel off one norm, one all-reduce per layer (gptj).
  sequential  pre-norm attention, then pre-norm MLP, two all-reduces per layer (llama).
  post_norm   attention, then MLP, each output normalized before its residual add (olmo2).
  sandwich    attention, then MLP, each normalized before and after (gemma2, gemma3).

Shapes: tokens [B, T] global ids; hidden x [B, T, D] replicated over the model axis.
"""

from __future__ import annotations

import functools

import haiku as hk
import jax.numpy as jnp
import numpy as np
from jax import lax

from meshlm.errors import ConfigError
from meshlm.model import masked, mtp, per_layer, per_layer_runs
from meshlm.model.attention import doc_starts
from meshlm.model.chunked_xent import Head, HeadRows, head_mean
from meshlm.model.config import ModelConfig
from meshlm.model.layer_kinds import DENSE_STACK, LINEAR_STACK
from meshlm.model.layers import (
    MLP,
    LayerNorm,
    RMSNorm,
    RMSNormPlusOne,
    RMSNormProductFirst,
    VocabEmbed,
    VocabHead,
)
from meshlm.model.linear_attention import linear_layer, linear_mixer
from meshlm.model.lora import freeze
from meshlm.model.lora_dropout import SEEDS, scope
from meshlm.model.memory import layer_gathers, parallel_getter
from meshlm.model.mla import attention_module
from meshlm.model.moe import aux_loss, moe_layer, moe_losses
from meshlm.model.stack import stack_layers
from meshlm.parallel.context import Parallel
from meshlm.settings import FLASH_UNDER_CP

GPT_STDDEV = 0.02  # GPT-J / Llama initialisation


def _ff_layer(cfg: ModelConfig, par: Parallel):
    s = 1.0 / np.sqrt(cfg.d_model)  # the prototype's hk.Linear default and its output init

    def layer(x, positions, cache=None, starts=None, kind=None):  # no attention: positions unused
        mlp = MLP(
            hidden_dim=cfg.d_ff, par=par, kind="gelu", bias=True, stddev_in=s, stddev_out=s, quant=cfg.quant
        )
        partial, b = mlp(par.f(x))
        return x + par.row_out(partial, b), cache

    return layer


def _mlp(cfg: ModelConfig, par: Parallel) -> MLP:
    """The transformer families' MLP (GPT-J/Llama initialisation)."""
    fam = cfg.arch
    return MLP(
        hidden_dim=cfg.d_ff,
        par=par,
        kind=fam.mlp,
        bias=fam.biases,
        stddev_in=GPT_STDDEV,
        stddev_out=GPT_STDDEV,
        lora=cfg,
        quant=cfg.quant,
    )


def _norm(cfg: ModelConfig, name: str):
    return NORMS[cfg.arch.norm](eps=cfg.norm_eps, name=name)


def _parallel_layer(cfg: ModelConfig, par: Parallel):
    def layer(x, positions, cache=None, starts=None, kind=None):
        xf = par.f(_norm(cfg, "ln")(x))  # one f for both branches
        attn, cache = attention_module(cfg, par, GPT_STDDEV)(xf, positions, cache, starts, kind)
        mlp, b = _mlp(cfg, par)(xf)
        return x + par.row_out(attn + mlp, b), cache  # one all-reduce for both branches

    return layer


def _sequential_layer(cfg: ModelConfig, par: Parallel):
    def layer(x, positions, cache=None, starts=None, kind=None):
        xf = par.f(_norm(cfg, "ln")(x))
        attn, cache = attention_module(cfg, par, GPT_STDDEV)(xf, positions, cache, starts, kind)
        x = x + par.row_out(attn)
        xf = par.f(_norm(cfg, "ln2")(x))
        mlp, b = _mlp(cfg, par)(xf)
        return x + par.row_out(mlp, b), cache

    return layer


def _post_norm_layer(cfg: ModelConfig, par: Parallel):
    """OLMo 2: each branch's output normalized before the residual add (its input is not). With sp the
    norms see the sequence slices the row-parallel sums scatter to: per token, as unsharded."""

    def layer(x, positions, cache=None, starts=None, kind=None):
        attn, cache = attention_module(cfg, par, GPT_STDDEV)(par.f(x), positions, cache, starts, kind)
        x = x + _norm(cfg, "post_attn_ln")(par.row_out(attn))
        mlp, b = _mlp(cfg, par)(par.f(x))
        return x + _norm(cfg, "post_mlp_ln")(par.row_out(mlp, b)), cache

    return layer


def _sandwich_layer(cfg: ModelConfig, par: Parallel):
    """Gemma 2/3: each branch's input normalized (ln, ln2) and its output too (post_attn_ln,
    post_mlp_ln), before the residual add. With sp the output norms see the sequence slices the
    row-parallel sums scatter to: per token, as unsharded."""

    def layer(x, positions, cache=None, starts=None, kind=None):
        xf = par.f(_norm(cfg, "ln")(x))
        attn, cache = attention_module(cfg, par, GPT_STDDEV)(xf, positions, cache, starts, kind)
        x = x + _norm(cfg, "post_attn_ln")(par.row_out(attn))
        mlp, b = _mlp(cfg, par)(par.f(_norm(cfg, "ln2")(x)))
        return x + _norm(cfg, "post_mlp_ln")(par.row_out(mlp, b)), cache

    return layer


def _block(cfg: ModelConfig, par: Parallel):
    """The family's layer: x -> (x, cache), or with a mixture of experts (x, cache, statistics)."""
    if cfg.arch.moe and not cfg.per_layer:  # Gemma 4's experts: in its own block
        attention = lambda: attention_module(cfg, par, GPT_STDDEV)
        return moe_layer(cfg, par, norm=lambda name: _norm(cfg, name), attention=attention, stddev=GPT_STDDEV)
    return BLOCKS[cfg.arch.block](cfg, par)


def _others(cfg: ModelConfig, par: Parallel) -> dict:
    """The layers of a second kind, by stack name (``layer_kinds.stacks``): a mixture of experts' dense
    layers, a hybrid's linear-attention layers (``model.linear_attention``); none: every layer alike."""
    if cfg.dense_layers:
        return {DENSE_STACK: BLOCKS[cfg.arch.block](cfg, par)}
    norm = lambda name: _norm(cfg, name)
    if cfg.full_attn_every and cfg.arch.moe:  # the experts after the linear mixer too (Qwen3.5-MoE)
        mixer = lambda: linear_mixer(cfg, par, GPT_STDDEV)
        return {LINEAR_STACK: moe_layer(cfg, par, norm=norm, attention=mixer, stddev=GPT_STDDEV)}
    if cfg.full_attn_every:
        return {LINEAR_STACK: linear_layer(cfg, par, norm, lambda: _mlp(cfg, par), GPT_STDDEV)}
    return {}


BLOCKS = {  # Family.block
    "ff": _ff_layer,
    "parallel": _parallel_layer,
    "sequential": _sequential_layer,
    "post_norm": _post_norm_layer,
    "sandwich": _sandwich_layer,
    "per_layer": lambda cfg, par: per_layer.block(
        cfg, par, lambda name: _norm(cfg, name), lambda: _mlp(cfg, par)
    ),
}
NORMS = {  # Family.norm
    "layer": LayerNorm,
    "rms": RMSNorm,
    "rms_plus_one": RMSNormPlusOne,
    "rms_product_first": RMSNormProductFirst,
}


def local_logits(cfg: ModelConfig, par: Parallel, tokens, positions=None, cache=None, starts=None):
    """tokens [B, T] -> (per-shard logits [B, T, V/mp], new cache or None); V is the padded vocabulary
    (``cfg.padded_vocab``): columns from ``cfg.vocab_size`` on are padding, for callers to mask.
    With ``cfg.doc_mask``: ``starts`` [B, T], where each token's document starts (absolute positions;
    default: from the EOD ids in ``tokens``, a window whose first token is at position 0)."""
    logits, cache, _ = local_logits_stats(cfg, par, tokens, positions, cache, starts)
    return logits, cache


def local_logits_stats(
    cfg: ModelConfig,
    par: Parallel,
    tokens,
    positions=None,
    cache=None,
    starts=None,
    mtp_ids=None,
    after=None,
    rows=False,
):
    """``local_logits`` and the layers' routing statistics of this shard's tokens ([L, 2E + 3] with a
    mixture of experts, ``model.moe``; None without). With ``mtp_ids`` (each MTP depth's tokens,
    ``model.mtp``) also (the depths' per-shard logits, their routing statistics); with ``after`` also
    ``after(x [B, T, D] before the final norm, logits, the parts MTP shares)`` (``generate.speculative``).
    With ``rows`` the logits' place holds what the chunked loss takes (``chunked_xent.HeadRows``)."""
    check_inputs(cfg, par, tokens.shape[-1])
    par.seq_len_check(tokens.shape[-1])
    # FSDP gathers, SP norm hook (``Parallel.param``); with LoRA the base frozen (``lora.freeze``)
    with hk.custom_getter(parallel_getter(par)), freeze(cfg):
        return _local_logits(cfg, par, tokens, positions, cache, starts, mtp_ids, after, rows)


def _local_logits(
    cfg: ModelConfig, par: Parallel, tokens, positions, cache, starts, mtp_ids=None, after=None, rows=False
):
    if positions is None:  # global positions: with cp, those of this shard's chunks
        positions = jnp.broadcast_to(par.positions(tokens.shape[-1]), tokens.shape)
    if cfg.doc_mask >= 0:
        starts = par.tap("doc_starts", doc_starts(tokens, cfg.doc_mask) if starts is None else starts)
    embed = _embed(cfg, par)
    x = _scaled(cfg, embed(tokens))  # [B, T, D]; with sp [B, T/mp, D] per shard
    if cfg.per_layer:  # Gemma 4: per-layer inputs [L, B, T, P], keys and values across layers
        ple = per_layer.inputs(cfg, par, tokens, x)
        stack = per_layer_runs.split_stack if cfg.global_shape else per_layer.stack  # global: own shape
        x, cache, stats = stack(cfg, par, lambda c: _block(c, par), x, positions, cache, starts, ple)
        return _head_logits(cfg, par, x, embed, rows), cache, stats
    x, cache, *stats = stack_layers(
        cfg, _block(cfg, par), x, positions, cache, starts, _others(cfg, par), layer_gathers(par)
    )
    if rows:  # the chunked loss's (no MTP: ``ModelConfig`` refuses it with loss_chunk)
        return _head_logits(cfg, par, x, embed, rows), cache, (stats[0] if stats else None)
    head = _head(cfg, par, embed)  # one module: the MTP depths share it
    out = (head(_final_norm(cfg, x)), cache, (stats[0] if stats else None))
    if after is not None:
        return (*out, after(x, out[0], mtp_parts(cfg, par, embed, head)))
    if mtp_ids is None:
        return out
    parts = mtp_parts(cfg, par, embed, head)
    return (*out, mtp.depth_logits(cfg, par, x, mtp_ids, **parts, positions=positions, starts=starts))


def mtp_parts(cfg: ModelConfig, par: Parallel, embed, head) -> dict:
    """What the MTP depths share with the main model (``mtp.depth_logits``'s keywords)."""
    block, norm = (lambda: _block(cfg, par)), (lambda name: _norm(cfg, name))
    return dict(embed=lambda t: _scaled(cfg, embed(t)), head=head, block=block, norm=norm, stddev=GPT_STDDEV)


def check_inputs(cfg: ModelConfig, par: Parallel, seq_len: int) -> None:
    """One-line errors before the model runs: learned positions end at max_seq_len (rotary ones go on:
    ``model.config.beyond_max_seq_len``); what context parallelism cannot run (``check_context``)."""
    if seq_len > cfg.max_seq_len and cfg.arch.attention and cfg.arch.rotary is None:  # learned
        raise ConfigError(f"sequence length {seq_len} exceeds max_seq_len={cfg.max_seq_len}")
    check_context(cfg, par)


def check_context(cfg: ModelConfig, where) -> None:
    """What context parallelism (``where``: a Parallel, or a Layout: the pipeline's start-up check, its
    pieces run inside the schedule) cannot run of ``cfg``, as one-line errors before any work."""
    par = where if isinstance(where, Parallel) else Parallel.on(where)
    if par.context_parallel and cfg.doc_mask >= 0:
        raise ConfigError("--cp does not support --doc-mask yet (documents across chunks); drop one of them")
    if par.context_parallel and cfg.attention == "flash":
        check_flash_ring(cfg, par)


def check_flash_ring(cfg: ModelConfig, par: Parallel) -> None:
    """What the flash kernel's ring steps (``model.flash_ring``) cannot run: the all-gather strategy, and
    windows or chunks (their masks by global position differ per chunk pair)."""
    if not par.cp_ring:
        raise ConfigError(FLASH_UNDER_CP)
    if cfg.sliding_window or cfg.attn_chunk:
        raise ConfigError(
            f"--attention flash under --cp does not run sliding windows or chunks yet (sliding_window="
            f"{cfg.sliding_window}, attn_chunk={cfg.attn_chunk}); use --attention blockwise"
        )


def _scaled(cfg: ModelConfig, x):
    if cfg.arch.embed_scale:  # Gemma: sqrt(d_model), rounded to float32, in the embedding's dtype
        x = x * jnp.asarray(embed_scale(cfg.d_model), x.dtype)
    return x


def _embed(cfg: ModelConfig, par: Parallel) -> VocabEmbed:
    stddev = GPT_STDDEV if cfg.arch.gpt_init else 1.0 / np.sqrt(cfg.vocab_size)
    return VocabEmbed(
        vocab_size=cfg.padded_vocab,
        d_model=cfg.d_model,
        par=par,
        stddev=stddev,
        bias=cfg.embed_bias,
        real_vocab=cfg.vocab_size,
    )


def _head_logits(cfg: ModelConfig, par: Parallel, x, embed: VocabEmbed | None, rows: bool = False):
    """Final norm (if the family has one) and the output projection: per-shard logits [B, T, V/mp];
    with ``rows`` what the chunked loss takes instead (``chunked_xent.HeadRows``)."""
    head = _head(cfg, par, embed)
    return HeadRows(_final_norm(cfg, x), head.weights()) if rows else head(_final_norm(cfg, x))


def _final_norm(cfg: ModelConfig, x):
    return x if cfg.arch.norm is None else _norm(cfg, "final_ln")(x)


def _head(cfg: ModelConfig, par: Parallel, embed: VocabEmbed | None) -> Head:
    """The output projection, normalized x [B, T, D] -> per-shard logits [B, T, V/mp]: one module
    (or the tied embedding), so that every use shares its parameters."""
    if cfg.tie_embeddings:
        return Head(cfg, par, embed.head_weights)
    head_stddev = GPT_STDDEV if cfg.arch.gpt_init else 1.0 / np.sqrt(cfg.d_model)
    head = VocabHead(
        vocab_size=cfg.padded_vocab,
        par=par,
        stddev=head_stddev,
        bias=cfg.arch.biases,
        real_vocab=cfg.vocab_size,
    )
    return Head(cfg, par, lambda: head.weights(cfg.d_model))


def embed_scale(d_model: int) -> np.float32:
    """Gemma's embedding multiplier: sqrt(d_model) as transformers makes it (a float32 tensor, then
    cast to the embedding's dtype)."""
    return np.float32(np.sqrt(d_model))


def loss_fn(cfg: ModelConfig, par: Parallel, routing: bool = False, metrics: bool = False):
    """A Haiku function: batch {"inputs", "targets": [B, T]} -> mean loss over the global batch (with
    "weights" [B, T]: of the weighted losses, ``model.masked``: the SFT loss; with ``lora_dropout.SEEDS``
    the adapters' dropout); with
    ``routing`` (a mixture of experts) -> (that loss, the routing statistics of the whole global batch
    [L, 2E + 3], ``model.moe``: the train step's metrics, outside the gradient); with ``metrics`` and
    multi-token prediction on -> (that loss, {"mtp": the depths' losses [D], "routing" with ``routing``}).
    """

    def loss(batch):  # with cp, each shard computes its own chunks of the sequence (``parallel.cp``)
        seeds = par.seq_local(batch[SEEDS]) if SEEDS in batch else None  # the train step's, for dropout
        ids = mtp.local_ids(cfg, par, batch) if cfg.mtp_on else None  # each MTP depth's tokens
        with scope(cfg, seeds):
            out, _, stats, *depths = local_logits_stats(
                cfg, par, par.seq_local(batch["inputs"]), mtp_ids=ids, rows=bool(cfg.loss_chunk)
            )
        targets = par.seq_local(batch["targets"])  # [B, T] (with cp: [B, T/cp])
        weights = par.seq_local(batch[masked.WEIGHTS]) if masked.WEIGHTS in batch else None  # SFT
        loss = head_mean(cfg, par, out, targets, weights)  # this shard's mean
        summed = par.moe_sum(stats) if stats is not None and (routing or moe_losses(cfg)) else None
        if summed is not None and moe_losses(cfg):  # of the whole global batch's statistics
            loss = loss + aux_loss(cfg, summed).astype(loss.dtype)
        if depths:  # multi-token prediction: + lambda / D x the depths' losses (``model.mtp``)
            mtp.check_batch(cfg, batch, masked.WEIGHTS)
            per_depth = mtp.depth_losses(cfg, par, batch, depths[0][0])
            loss = loss + mtp.weighted(cfg, par, per_depth).astype(loss.dtype)
        if metrics and depths:  # the train step's: the depths' losses beside the routing
            aux = {"mtp": lax.stop_gradient(par.batch_mean(per_depth))}
            return par.batch_mean(loss), aux | ({"routing": lax.stop_gradient(summed)} if routing else {})
        if routing:
            return par.batch_mean(loss), lax.stop_gradient(summed)
        return par.batch_mean(loss)

    return loss


def logits_fn(cfg: ModelConfig, par: Parallel):
    """A Haiku function: tokens [B, T] -> full logits [B, T, V] (gathered over the model axis; the
    vocabulary padding stripped: V = ``cfg.vocab_size``)."""

    def logits(tokens, positions=None):
        local, _ = local_logits(cfg, par, tokens, positions)
        return par.gather_last(local)[..., : cfg.vocab_size]

    return logits


def init_fn(cfg: ModelConfig):
    """(Haiku init of the unsharded model, an example batch for it). Parameter shapes do not depend on
    the batch, so a tiny one serves for ``eval_shape`` and for sharded initialisation alike."""
    t = min(cfg.max_seq_len, 8)
    example = {k: jnp.zeros((1, t), jnp.int32) for k in ("inputs", "targets")}
    return _haiku_init(cfg), example


@functools.lru_cache(maxsize=64)
def _haiku_init(cfg: ModelConfig):
    """One init function per config: JAX's trace cache knows a function by its identity, so a config's
    shapes (``param_shapes``) and initialisations after the first reuse its traced forward (a trace costs
    0.06-0.5 s CPU: tiny presets to deepseek-v3; ``meshlm plan``'s search and the tests trace a config
    again and again)."""
    return hk.transform(loss_fn(cfg, Parallel())).init


def param_shapes(cfg: ModelConfig):
    """The global parameter shapes (ShapeDtypeStructs) of ``cfg``'s model; nothing is allocated."""
    import jax

    init, example = init_fn(cfg)
    return jax.eval_shape(init, jax.random.PRNGKey(0), example)
