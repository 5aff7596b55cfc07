"""The fewest collectives a training step needs under Megatron tensor parallelism, by cause.

``bench`` reports this next to what XLA actually compiled (``hlo.collectives_per_step``). The two
may differ where XLA combines independent all-reduces over the same devices into one: e.g. with
dp > 1 the scalar loss mean over DP travels in the DP gradient all-reduce.
"""

from __future__ import annotations

import jax

from meshlm.model.attention import kv_replicated
from meshlm.model.config import ModelConfig
from meshlm.model.moe import moe_losses, stats_size
from meshlm.model.mtp_fields import as_layers


def theoretical_collectives(cfg: ModelConfig, dp: int, mp: int, cp: int = 1) -> dict[str, int]:
    """The fewest all-reduces one training step needs under Megatron tensor parallelism, by cause.

    Per step (a layer loop that runs L times counts L times). With mp > 1 activations between blocks
    are replicated over MP and the weights split, so per layer:

    * forward, one all-reduce per exit from a row-parallel matmul (``par.g`` / ``row_out``;
      ``Family.row_sums``): gptj's parallel block sums the attention and MLP partials in one (1);
      llama's sequential attention then MLP needs two (2); the ff prototype's MLP one (1). With
      ``remat`` the backward pass recomputes the forward, its all-reduces included, so these count twice.
    * backward, one per entry into a column-parallel region (``par.f``, whose transpose sums the
      input gradient over MP): again 1 / 2 / 1.
    * KV projections replicated because mp > n_kv_heads: their gradients (with Qwen2's KV biases)
      summed over MP (1; XLA may combine it with the layer's backward all-reduce, independent of it).
    * Qwen3's and Gemma 3's q/k norm weights (``Family.qk_norm`` "head", "head_plus_one"): replicated,
      used on this shard's heads, so their gradients are summed over MP (2, q's and k's; only for such
      families). OLMo 2's
      ("proj"): the mean squares of q and k over the whole projection, [B, T] each, summed over MP
      forward (2, twice with remat) and their shared cotangents backward (2); where the KV heads are
      replicated, the k norm's replicated weights' gradient too (1).

    Outside the layers, with mp > 1:

    * embedding: the vocabulary-parallel lookup sums partial rows forward (1); its backward is
      local (each shard scatters into its own rows): none.
    * output projection: its input enters a column-parallel region: 1 backward.
    * vocabulary-parallel cross-entropy: max, target logit and sum of exp over the shards, three
      small [B, T] all-reduces forward (3; the last two are independent and may be combined). Their
      backward is local (the max is under stop_gradient; a psum transposes to the identity).
    * gradient clipping: the squared norm of the MP-sharded gradients summed over MP (1 scalar;
      we assume clipping is on, ``OptimConfig``'s default).

    With dp > 1: the gradient all-reduce over DP (1 if every gradient goes in one tuple; the bytes
    are those of one device's parameters whatever the count) and the loss mean over DP (1 scalar,
    for reporting the loss). Replicated parameters (norms, biases added after an all-reduce) need
    no MP all-reduce: they act on replicated activations. With context parallelism (``--cp``) the
    gradient and loss all-reduces run over dp x cp (one each, as for dp). Returns counts by cause and
    ``total``.
    """
    per_layer = cfg.arch.row_sums
    sharded = mp > 1
    mtp, cfg = mtp_depths(cfg), as_layers(cfg)  # MTP's blocks counted as layers, the rest below
    batch_shards = dp * cp  # the shards the loss and gradients are means over (``Axis.batch``)
    kv_rep = cfg.arch.attention and sharded and kv_replicated(cfg.kv_heads, mp)
    out = {
        "layer_forward": cfg.n_layers * per_layer * (2 if cfg.remat != "none" else 1) * sharded,
        "layer_backward": cfg.n_layers * per_layer * sharded,
        "kv_replicated_grads": sum(len(layers) for layers, _, _ in _kv_replicated_kinds(cfg, mp)),
        "embedding": int(sharded),
        "head_backward": int(sharded),
        "loss": 3 * sharded,
        "grad_norm": int(sharded),
        "dp_gradients": int(batch_shards > 1),
        "dp_loss": int(batch_shards > 1),
    }
    if cfg.arch.moe:
        out["moe_weights_backward"] = len(cfg.moe_layers) * sharded  # dense layers have no routing
        out["moe_statistics"] = int(batch_shards > 1 and moe_losses(cfg))
        if cfg.shared_expert_d_ff:  # Qwen2-MoE's shared gate [D, 1]: replicated, meets mp's partials
            out["moe_shared_gate_grads"] = len(cfg.moe_layers) * sharded
    if cfg.arch.qk_norm in ("head", "head_plus_one"):
        out["qk_norm_grads"] = 2 * cfg.n_layers * sharded
    elif cfg.arch.qk_norm == "proj":
        out["qk_norm_stats"] = cfg.n_layers * 2 * (3 if cfg.remat != "none" else 2) * sharded
        out["qk_norm_grads"] = cfg.n_layers * kv_rep
    if cfg.mla:  # MLA's replicated down-projections and their norms meet mp's heads (``model.mla``)
        out["mla_latent_grads"] = cfg.n_layers * (4 if cfg.q_lora_rank else 2) * sharded
    if mtp:  # per MTP depth (``model.mtp``): the shifted ids' lookup, eh_proj's row-parallel pair, the
        # head's input and the cross-entropy, as the main model's
        out |= dict(mtp_embedding=mtp, mtp_eh_proj=2 * mtp, mtp_head_backward=mtp, mtp_loss=3 * mtp)
        out = {k: v * sharded if k.startswith("mtp_") else v for k, v in out.items()}
    out["total"] = sum(out.values())
    return out


def chunked_loss_extra(cfg, layout, *, batch: int, seq_len: int, itemsize: int) -> tuple[int, int]:
    """The all-reduces (count, bytes) that the chunked cross-entropy (``cfg.loss_chunk``,
    ``model.chunked_xent``) adds to ``theoretical_collectives``' "loss" with mp > 1: its three small
    all-reduces run per chunk of c tokens, in the forward that also computes the gradients (their
    transposes communicate nothing): 3 k of [c], k = ceil(tokens per shard / c) (the last chunk
    padded), for the whole loss's 3 of [N]."""
    if not cfg.loss_chunk or layout.mp == 1:
        return 0, 0
    n = (batch // layout.dp) * (seq_len // layout.cp)  # [B/dp, T/cp]: this shard's tokens
    k = -(-n // cfg.loss_chunk)
    return 3 * k - 3, (3 * k * cfg.loss_chunk - 3 * n) * itemsize


def _kv_replicated_kinds(cfg, mp: int) -> list:
    """The attention shapes (``PerLayerFields.attention_kinds``: layer indices, KV heads, head width)
    whose KV projections are replicated over mp (mp > their KV heads): their gradients are summed."""
    if not (cfg.arch.attention and mp > 1):
        return []
    return [kind for kind in cfg.attention_kinds() if kv_replicated(kind[1], mp)]


def mtp_depths(cfg) -> int:
    """The multi-token prediction depths a training step runs (0: none, or their weight 0)."""
    return cfg.mtp_layers if cfg.mtp_on else 0


def mla_latent_values(cfg) -> int:
    """Values of one MLA layer's replicated latent weights: wq_a [D, Q], q_a_norm [Q], wkv_a [D, r + R],
    kv_a_norm [r] (their gradients are summed over mp)."""
    return (cfg.d_model + 1) * (cfg.q_lora_rank + cfg.kv_lora_rank) + cfg.d_model * cfg.rot_dim


def theoretical_bytes(
    cfg: ModelConfig,
    dp: int,
    mp: int,
    *,
    batch: int,
    seq_len: int,
    itemsize: int,
    param_bytes: int,
    cp: int = 1,
) -> dict[str, int]:
    """Result bytes of those all-reduces in one step, by the same causes (per device; global batch
    ``batch`` split over dp, activations of ``itemsize`` bytes, ``param_bytes`` of parameters on one
    device). Combining all-reduces changes their count, never their bytes, so this is the firmer
    check. The scalars (the clip's squared norm, the DP loss mean) count 1 value each here; XLA may
    send the clip's norm as one partial sum per sharded leaf and axis, a few bytes more
    (``scalar_slack``).
    """
    counts, layers = theoretical_collectives(cfg, dp, mp, cp), as_layers(cfg).n_layers
    seq_len //= cp  # with context parallelism each device holds T/cp tokens of its rows
    act = (batch // dp) * seq_len * cfg.d_model * itemsize  # [B/dp, T, D]: one activation all-reduce
    kv_rows = cfg.d_model + cfg.arch.qkv_bias  # replicated wk, wv [D, K, E] (and Qwen2's bk, bv [K, E])
    kv_kinds = _kv_replicated_kinds(as_layers(cfg), mp)  # each attention shape's own K, E (Gemma 4's)
    out = {
        "layer_forward": counts["layer_forward"] * act,
        "layer_backward": counts["layer_backward"] * act,
        "kv_replicated_grads": sum(2 * kv_rows * len(ls) * k * e * itemsize for ls, k, e in kv_kinds),
        # with per-layer inputs (Gemma 4) their vocabulary-parallel table's lookup too: [B/dp, T, L x P]
        "embedding": counts["embedding"] * (act + act // cfg.d_model * cfg.n_layers * cfg.ple_dim),
        "head_backward": counts["head_backward"] * act,
        "loss": counts["loss"] * (batch // dp) * seq_len * itemsize,  # [B/dp, T] each
        "grad_norm": counts["grad_norm"] * itemsize,
        "dp_gradients": counts["dp_gradients"] * param_bytes,
        "dp_loss": counts["dp_loss"] * itemsize,
    }
    if mtp_depths(cfg):  # eh_proj: [B/dp, T, D] forward, its joined input's [B/dp, T, 2D] backward
        out |= {k: counts[k] * act for k in ("mtp_embedding", "mtp_head_backward")}
        out["mtp_eh_proj"] = counts["mtp_eh_proj"] // 2 * 3 * act
        out["mtp_loss"] = counts["mtp_loss"] * (batch // dp) * seq_len * itemsize
    if "qk_norm_grads" in counts and cfg.arch.qk_norm == "proj":  # [K, E] (OLMo 2's k norm, replicated)
        out["qk_norm_grads"] = counts["qk_norm_grads"] * cfg.kv_heads * cfg.dim_per_head * itemsize
    elif "qk_norm_grads" in counts:  # [E] each (Qwen3's), of each attention shape's E (Gemma 4's)
        widths = sum(len(ls) * e for ls, _, e in as_layers(cfg).attention_kinds())  # over the layers
        out["qk_norm_grads"] = counts["qk_norm_grads"] // max(layers, 1) * widths * itemsize
    if cfg.arch.moe:  # [B/dp, T, k] per layer; [L, 2E + 3] once
        out["moe_weights_backward"] = (
            counts["moe_weights_backward"] * (batch // dp) * seq_len * (cfg.experts_per_token * itemsize)
        )
        stats = len(cfg.moe_layers) * stats_size(cfg)
        out["moe_statistics"] = counts["moe_statistics"] * stats * itemsize
        out["moe_shared_gate_grads"] = counts.get("moe_shared_gate_grads", 0) * cfg.d_model * itemsize
    # Replicated biases added once, on mp shard 0 (``dense.add_once``: gpt-oss's attention output [D] per
    # layer, its experts' down [E, D] per MoE layer): their gradients summed over mp
    once = cfg.arch.o_bias * layers + (cfg.arch.moe and cfg.expert_bias) * len(cfg.moe_layers) * cfg.n_experts
    out["once_bias_grads"] = (mp > 1) * once * cfg.d_model * itemsize
    if "mla_latent_grads" in counts:
        out["mla_latent_grads"] = (
            bool(counts["mla_latent_grads"]) * layers * mla_latent_values(cfg) * itemsize
        )
    if "qk_norm_stats" in counts:  # [B/dp, T] each
        out["qk_norm_stats"] = counts["qk_norm_stats"] * (batch // dp) * seq_len * itemsize
    out["total"] = sum(out.values())
    return out


def scalar_slack(params, itemsize: int) -> int:
    """Bytes XLA may add by reducing the clip's squared norm as one partial sum per parameter leaf and
    mesh axis the leaf is split over (a weight split over dp and mp under FSDP: its partial sums may
    travel over each axis apart; replicated leaves one)."""

    def axes(p) -> int:
        spec = getattr(getattr(p, "sharding", None), "spec", ())
        return sum(len(d) if isinstance(d, tuple) else d is not None for d in spec)

    return sum(max(1, axes(p)) for p in jax.tree.leaves(params)) * itemsize
