"""Activation memory per device, from Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models" (arXiv:2205.05198), section 4 and table 2.

Their count for one transformer layer at 16 bits, s = sequence, b = micro-batch rows, h = d_model,
a = heads, t = tensor-parallel size (our ``mp``):

  attention  11·sbh + 5·as²b   (QKV input 2, Q and K 4, softmax 2as²b, its dropout mask as²b,
                               dropout output 2as²b, V 2, output-projection input 2, dropout mask 1)
  MLP        19·sbh            (input 2, GeLU input 8, GeLU output 8, dropout mask 1)
  norms       4·sbh            (two LayerNorm inputs, 2 each)

Under tensor parallelism 10·sbh of it (block inputs, norms, dropout masks) is replicated on every
device and the rest is split t ways; sequence parallelism splits the replicated part too:

  policy     TP                          TP + SP
  none       sbh·(10 + 24/t + 5as/(ht))  sbh/t·(34 + 5as/h)
  selective  sbh·(10 + 24/t)             sbh/t·34          (the as²b terms are recomputed)
  full       2·sbh                       2·sbh/t           (only each layer's input is kept)

Full recompute also holds one layer's activations while that layer is recomputed in the backward
pass; we add them (the paper's table counts only the stored inputs).

What the formula assumes, and how meshlm differs:
  * 16-bit activations: we scale by the compute dtype (float32 doubles every term; ``--bf16`` keeps
    them). Dropout masks (1 byte each) are counted although meshlm has no dropout: an over-count
    of (2·sbh + as²b)·(1 or 1/t) per layer.
  * A GPT MLP of width 4h with one GeLU. Llama's SwiGLU keeps three d_ff-wide tensors instead of
    two 4h-wide ones: for llama2-7b 3·11008 ≈ 8·4096, so the figure is close; gptj's MLP matches.
  * Multi-head attention: grouped-query attention (n_kv_heads < n_heads) keeps smaller K and V.
  * The ff prototype has no attention: its layer is the MLP and one norm (replicated 5·sbh,
    split 16·sbh), from the same component list.
Outside the layers we add the head's logits and their softmax in float32 (2 · 4 · s·b·V/t bytes,
the vocabulary is split over mp; with ``--loss-chunk c`` only one chunk's, 2 · 4 · c·V/t, and the
float32 sum of the head's weight gradient, 4 · h·V/t); the paper neglects the embedding and head.

A mixture-of-experts layer (``model.moe``; ``model.accounting.moe_layers`` of them) keeps the table's
attention and norms but not its MLP (less the MLP's dropout mask 1 and GeLU 16: replicated 9, split 8),
and instead what the dropless dispatch keeps (``parallel.experts``, ``parallel.ep``). With N = s·b the
tokens of the shard (the column-parallel view: the whole sequence even under SP), E experts, k chosen:
the sorted dispatch keeps its routed rows (``moe_bytes``); the "dense" one: every expert computes on
every token's slot, E·N slots per device (with ep: E/ep experts on the ep·N
tokens of the group), each keeping its input (D values) and 6 hidden tensors of I/mp (``MOE_HIDDEN``:
what JAX's autodiff saves of silu(x W_gate) · (x W_up), by ``jax.ad_checkpoint.print_saved_residuals``:
both projections, three of silu's and the product); the combine keeps the k chosen outputs (k·N·D)
for the weights' gradient; with ep the dispatch's where-mask (E·N·D bytes); a shared expert (Qwen2-MoE)
6·N·I_shared/mp. For mixtral-8x7b on 8x8 + EP8 (batch 8 × 128) that is 66 MiB per layer against the
table's 5 MiB for a dense layer of the same width. Selective remat does not keep the experts' batched
matmuls (jax's ``dots_with_no_batch_dims_saveable``): the MoE part is recomputed, one layer's at a time,
as full remat's.
"""

from __future__ import annotations

from meshlm.errors import ConfigError
from meshlm.model.accounting import moe_layers
from meshlm.model.config import ModelConfig
from meshlm.model.family import NAMED_REMAT, REMAT

PAPER_BYTES = 2  # the paper's activation width (16-bit)
# Per-layer coefficients of s·b·h at 16 bits: (replicated under TP, split by t).
COEFFS = {"transformer": (10, 24), "ff": (5, 16)}
ATTENTION_COEFF = 5  # the attention scores' terms: 5·a·s²·b (softmax, its dropout mask, dropout output)
FULL_REMAT_COEFF = 2  # full recompute keeps each layer's input: 2·sbh
LOGIT_COPIES = 2  # logits and their softmax, in float32
# A MoE layer's table part (replicated, split): the transformer's less its MLP's dropout mask and GeLU.
MOE_ATTENTION_COEFFS = (9, 8)
MOE_HIDDEN = 6  # hidden tensors (I / mp wide) an expert keeps per token slot (module docstring)


def logit_rows(cfg: ModelConfig, tokens: int) -> int:
    """The tokens whose float32 logits live at once: all of a micro-batch's, or with ``--loss-chunk``
    (``model.chunked_xent``) one chunk's."""
    return min(cfg.loss_chunk, tokens) if cfg.loss_chunk else tokens


def layer_bytes(
    cfg: ModelConfig,
    *,
    seq: int,
    micro_batch: int,
    mp: int,
    sp: bool,
    remat: str,
    act_bytes: int,
    moe: bool = False,
    ep: int = 1,
) -> float:
    """Bytes one device keeps for one layer's backward pass (the table above, scaled to act_bytes):
    a dense layer, or with ``moe`` a mixture-of-experts layer (its experts split over ep with ``ep``).

    ``micro_batch`` is the rows one device processes at once (global batch / (dp · accum_steps)).
    """
    if remat not in REMAT:
        raise ConfigError(f"remat={remat!r}; valid: {', '.join(REMAT)}")
    s, b, h, t = seq, micro_batch, cfg.d_model, mp
    sbh = s * b * h
    scale = act_bytes / PAPER_BYTES
    if remat == "full":
        return FULL_REMAT_COEFF * sbh / (t if sp else 1) * scale
    if remat in NAMED_REMAT:  # full's input, and the saved projections (split over mp)
        return (FULL_REMAT_COEFF * sbh / (t if sp else 1) + named_bytes(cfg, remat, s * b) / t) * scale
    replicated, split = COEFFS["transformer" if cfg.arch.attention else "ff"]
    if moe:
        replicated, split = MOE_ATTENTION_COEFFS
    attention = 0.0
    if remat == "none" and cfg.arch.attention:
        attention = ATTENTION_COEFF * cfg.n_heads * s * s * b / t
    kept = replicated * sbh / (t if sp else 1) + split * sbh / t
    experts = moe_bytes(cfg, tokens=s * b, mp=t, ep=ep, act_bytes=act_bytes) if moe and remat == "none" else 0
    return (kept + attention) * scale + experts


def named_bytes(cfg: ModelConfig, remat: str, tokens: int) -> float:
    """What a named policy saves of one layer, in the paper's 16-bit bytes, before the mp split: the
    q, k and v projections (tokens x (H + 2 K) x E), with save_qkv_mlp_in also the MLP's input
    projections (gate and up, or w_in: tokens x d_ff each)."""
    qkv = tokens * (cfg.n_heads + 2 * cfg.kv_heads) * cfg.dim_per_head
    mlp_in = tokens * cfg.d_ff * (2 if cfg.arch.mlp in ("swiglu", "geglu") else 1)
    return PAPER_BYTES * (qkv + (mlp_in if remat == "save_qkv_mlp_in" else 0))


def moe_bytes(cfg: ModelConfig, *, tokens: int, mp: int, ep: int, act_bytes: int) -> float:
    """What one MoE feed-forward keeps on one device for its backward (module docstring): ``tokens``
    N of the shard, ``ep`` the expert-parallel degree (1: none). The sorted dispatch: R rows
    (``parallel.grouped.row_bound`` of the ep·N gathered tokens and E/ep experts) of D (the row's
    input) + 2·I/mp (gate and up, the block scan's residuals) + D (its output, for the combine
    weights' gradient), with ep the gathered ep·N·D tokens; "dense": E·N expert slots of D + 6·I/mp
    values, the k·N·D chosen outputs, with ep the E·N·D-byte dispatch mask. A shared expert's
    6·N·I_shared/mp either way."""
    from meshlm.parallel.ep import gathered_tokens  # JAX's: imported when a MoE is planned

    shared = tokens * MOE_HIDDEN * cfg.shared_expert_d_ff / mp * act_bytes
    if cfg.moe_dispatch != "dense":
        from meshlm.parallel.gmm_tiling import parse_tiling
        from meshlm.parallel.grouped import row_bound

        how, tiling = cfg.moe_dispatch, parse_tiling(cfg.moe_gmm_tiling)
        rows = row_bound(ep * tokens, cfg.experts_per_token, cfg.n_experts // ep, how, tiling=tiling)
        values = rows * (2 * cfg.d_model + 2 * cfg.moe_d_ff / mp) + gathered_tokens(tokens, ep) * cfg.d_model
        return values * act_bytes + shared
    slots = cfg.n_experts * tokens
    values = (
        slots * (cfg.d_model + MOE_HIDDEN * cfg.moe_d_ff / mp) + cfg.experts_per_token * tokens * cfg.d_model
    )
    mask = slots * cfg.d_model * bool(gathered_tokens(tokens, ep))  # the dispatch's E·N·D mask: with ep
    return values * act_bytes + shared + mask


def activation_bytes(
    cfg: ModelConfig,
    *,
    seq: int,
    micro_batch: int,
    mp: int,
    sp: bool,
    remat: str,
    act_bytes: int,
    ep: int = 1,
) -> dict[str, float]:
    """Activation bytes on one device for one micro-batch: per layer (a MoE layer's, if the model has
    them), all layers, the head's logits. ``ep``: the experts split over an ep axis."""
    shape = dict(seq=seq, micro_batch=micro_batch, mp=mp, sp=sp, act_bytes=act_bytes, ep=ep)
    n_moe = moe_layers(cfg)
    dense, moe = (layer_bytes(cfg, remat=remat, moe=m, **shape) for m in (False, True))
    layers = (cfg.n_layers - n_moe) * dense + n_moe * moe
    if remat == "full" or remat in NAMED_REMAT:  # the layer being recomputed holds its full activations
        layers += layer_bytes(cfg, remat="none", moe=bool(n_moe), **shape)
    elif remat == "selective" and n_moe:  # the experts recomputed, one layer's at a time
        layers += moe_bytes(cfg, tokens=seq * micro_batch, mp=mp, ep=ep, act_bytes=act_bytes)
    logits = LOGIT_COPIES * 4 * logit_rows(cfg, seq * micro_batch) * cfg.vocab_size / mp
    if cfg.loss_chunk:  # the chunked loss's float32 sum of the head's weight gradient [D, V/mp]
        logits += 4 * cfg.d_model * cfg.vocab_size / mp
    per_layer = moe if n_moe else dense
    return {
        "per_layer": per_layer,
        "layers": layers,
        "logits": logits,
        "total": layers + logits,
        "moe_layers": n_moe,
    }
