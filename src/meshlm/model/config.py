"""Model configuration: one frozen dataclass, named presets, strict parsing.

Unknown preset names and unknown fields are errors that list the valid ones: a typo never silently
falls back to a default.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from meshlm.errors import ConfigError
from meshlm.model import layer_kinds as kinds
from meshlm.model.families import FAMILIES, preset_fields
from meshlm.model.family import NAMED_REMAT, Family
from meshlm.model.lora_fields import RANGES as LORA_RANGES
from meshlm.model.lora_fields import LoraFields, check_lora
from meshlm.model.loss_fields import LOSS_RANGES, LossFields
from meshlm.model.mla_fields import MLA_RANGES, MLAFields, check_mla
from meshlm.model.mtp_fields import MTP_RANGES, MTPFields, check_mtp
from meshlm.model.per_layer_fields import PER_LAYER_RANGES, PerLayerFields, check_per_layer
from meshlm.model.quant_fields import QuantFields, check_quant
from meshlm.model.rope import RopeScaling, YarnScaling, scaling_of
from meshlm.model.rope import inv_freq as rope_inv_freq
from meshlm.model.router_fields import ROUTER_RANGES, RouterFields, check_router
from meshlm.model.variant_fields import VariantFields, check_variant_fields
from meshlm.parallel.gmm_tiling import parse_tiling
from meshlm.ranges import NON_NEGATIVE_FLOAT, NON_NEGATIVE_INT, POSITIVE_FLOAT, POSITIVE_INT, Range

ATTENTION = ("plain", "blockwise", "flash")  # see meshlm.model.attention, .blockwise and .flash
# How a mixture of experts reaches its experts (``moe_dispatch``, ``parallel.grouped``): "dense" is the
# all-local reference, every expert on every token (``parallel.experts.dense_experts``): what the proof
# compares the others with. The commands' --moe-dispatch adds "auto" (``settings.dispatch_for``).
DISPATCHES = ("blocks", "ragged_dot", "gmm", "dense")


@dataclass(frozen=True)
class MoEFields:
    """``ModelConfig``'s mixture-of-experts fields (a base: its fields come first in the dataclass)."""

    # A mixture-of-experts feed-forward (``Family.moe``: ``model.moe``), 0 elsewhere: E experts, k per
    # token, each a gated MLP of ``moe_d_ff`` units; top-k weights renormalised (``norm_topk_prob``);
    # Qwen2-MoE's shared expert (its width; 0: none); the balance loss (``moe_aux_loss``: "hf", pooled
    # over layers, ~k when balanced, or "per-layer", Megatron's, ~1) and z-loss coefficients; the
    # capacity factor C (``model.moe.capacity_keep``): each expert takes at most ceil(C x tokens x k / E)
    # choices of a forward's global batch, dropped by GShard's whole-batch rule; 0: dropless. A saved
    # config without these fields predates them: a dense or dropless model, as it was.
    # ``dense_layers``: the sorted indices of the layers with the dense MLP of ``d_ff`` units among the
    # MoE layers (Qwen2-MoE's ``mlp_only_layers`` / ``decoder_sparse_step``); their parameters stack apart.
    # ``moe_dispatch`` (``DISPATCHES``) is not a model fact: the values are the same whichever is chosen
    # (the proof shows it). Each command puts the one it runs into the config it computes with (its
    # --moe-dispatch, "auto" by default: ``settings.dispatch_for``); none reads a saved config's value
    # ("blocks", or none before the field), so a saved config runs as the command's choice says. The
    # default here is the library's (a config built in code). (First: the field order of the config,
    # its JSON and its messages is as when it was a base of its own.)
    moe_dispatch: str = "blocks"
    n_experts: int = 0
    experts_per_token: int = 0
    moe_d_ff: int = 0
    norm_topk_prob: bool = True
    shared_expert_d_ff: int = 0
    router_aux_loss_coef: float = 0.0
    router_z_loss_coef: float = 0.0
    moe_aux_loss: str = "hf"
    moe_capacity_factor: float = 0.0
    dense_layers: tuple[int, ...] = ()
    # "gmm"'s kernel tiles, like ``moe_dispatch`` not a model fact (the command's --gmm-tiling): "auto"
    # (chosen from the shapes) or "TM,TK,TN" (``parallel.gmm_kernel``)
    moe_gmm_tiling: str = "auto"

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The indices of the layers whose feed-forward is a mixture of experts (none without one;
        ``arch`` and ``n_layers`` are ``ModelConfig``'s)."""
        if not self.arch.moe:
            return ()
        return tuple(i for i in range(self.n_layers) if i not in self.dense_layers)


@dataclass(frozen=True)
class ModelConfig(  # fields: its own, then its bases' (``field_names``)
    kinds.LinearAttentionFields, MLAFields, VariantFields, LoraFields, kinds.LayerKindFields, RouterFields,
    MoEFields, MTPFields, PerLayerFields, LossFields, QuantFields,
):  # fmt: skip
    family: str = "ff"  # "ff": the prototype's feed-forward stack; else a transformer (``model.families``)
    vocab_size: int = 256  # number of token ids; byte-level models use 256
    d_model: int = 128  # residual stream width
    n_layers: int = 2  # number of blocks (stacked with hk.experimental.layer_stack)
    d_ff: int = 512  # hidden width of the feed-forward / MLP (the prototype: 4 x d_model)
    n_heads: int = 0  # attention heads (transformers only; 0 for "ff")
    n_kv_heads: int = 0  # key/value heads; < n_heads is grouped-query attention; 0 means n_heads
    head_dim: int = 0  # per-head width; 0 means d_model // n_heads
    rotary_dim: int = 0  # gptj: rotary dims at the start of each head (interleaved); 0 = head_dim
    rotary_style: str = ""  # "interleaved" (GPT-J) or "half" (Llama); "" = the family's own
    rope_theta: float = 10000.0  # rotary base frequency
    max_seq_len: int = 256  # longest context; beyond it: learned positions refuse, rotary ones a note
    norm_eps: float = 1e-5  # LayerNorm / RMSNorm epsilon
    tie_embeddings: bool = False  # llama / qwen2: output projection reuses the embedding table
    embed_bias: bool = False  # ff: the prototype's embedding had a bias (added once, after the sum)
    z_loss: float = 0.0  # coefficient of the z-loss term coeff * log(Z)^2 (0 disables it)
    remat: str = "none"  # per-layer recomputation in the backward: "none" | "full" | "selective"
    # Embedding/head rows are padded to a multiple of this (Megatron's make-vocab-size-divisible-by): every
    # power-of-two mp up to it splits them; padded logits are masked. 1: none (a config saved without it).
    vocab_multiple: int = 128
    # Layers per iteration of the layer loop (scan unroll); 0: all of them, straight-line code (the
    # faster on CPU: ~1.2x on the cpu preset); a train step under FSDP or remat resolves 0 to 1
    # (train.step.step_model). Changes speed, memory and compile time, never results.
    unroll: int = 0
    # "plain": [B, H, T, T] scores; "blockwise": flash attention in blocks of attn_block queries and
    # keys, memory O(T) (model.blockwise; a ragged last block is padded, so any block size works);
    # "flash": JAX's fused Pallas splash-attention kernel (model.flash; TPU, else interpret mode).
    attention: str = "plain"
    attn_block: int = 512
    # Document masking (``--doc-mask``): >= 0 is the id that ends every document (the tokenizer's EOD);
    # attention then stays inside a document and positions restart at each (the EOD is the next
    # document's first input). Applies to training, evaluation and KV-cached generation. -1: off.
    doc_mask: int = -1
    # Sliding-window attention (Mistral): a query at position i sees the keys at positions j with
    # i - sliding_window < j <= i (transformers' definition: the window counts the query itself), in
    # plain and blockwise attention, under --cp, and in the KV cache (a rolling cache of the window's
    # slots when the context is longer). 0: off (full causal attention; a config saved without it).
    sliding_window: int = 0
    # Llama 3.x's rotary frequency scaling (rope_type "llama3") or YaRN ("yarn"; ``model.rope``); None: plain
    rope_scaling: RopeScaling | YarnScaling | None = None
    # Gemma 2's soft-capping: attention scores become c * tanh(s / c) before the mask and softmax
    # (``attn_softcap``), the output logits c * tanh(z / c) (``final_softcap``). 0: off. A saved config
    # without these fields predates them and loads as 0: exactly as it was. Every attention (plain,
    # blockwise, --cp ring and allgather) and the KV cache cap.
    attn_softcap: float = 0.0
    final_softcap: float = 0.0

    def __post_init__(self):
        if isinstance(self.remat, bool):  # checkpoints written before remat had policies
            object.__setattr__(self, "remat", "full" if self.remat else "none")
        object.__setattr__(self, "rope_scaling", scaling_of(self.rope_scaling))  # JSON: a dict
        dense = kinds.layer_indices("dense_layers", self.dense_layers)  # JSON: a list
        object.__setattr__(self, "dense_layers", dense)
        for f in dataclasses.fields(self):  # every construction path: presets, JSON, HF import
            if f.name in ("rope_scaling", "dense_layers"):
                continue
            object.__setattr__(self, f.name, _checked(f.name, f.type, getattr(self, f.name)))
        if self.family not in FAMILIES:
            raise ConfigError(f"unknown family {self.family!r}; valid: {', '.join(FAMILIES)}")
        if self.remat not in self.arch.remat:
            raise ConfigError(f"remat must be one of {', '.join(self.arch.remat)}, got {self.remat!r}")
        if self.attention not in ATTENTION:
            raise ConfigError(f"attention must be one of {', '.join(ATTENTION)}, got {self.attention!r}")
        if self.arch.attention:
            _check_attention(self)
        _check_kinds(self)
        check_variant_fields(self)
        if self.doc_mask >= self.vocab_size or (self.doc_mask >= 0 and not self.arch.attention):
            raise ConfigError(f"doc_mask={self.doc_mask} needs attention and an id below vocab_size")
        _check_parts(self)

    @property
    def arch(self) -> Family:
        """The record of this config's family (``model.families``): the facts that differ by family."""
        return FAMILIES[self.family]

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or (self.d_model // self.n_heads if self.n_heads else 0)

    @property
    def rotary_kind(self) -> str | None:
        """The rotary convention the model uses: ``rotary_style``, else its family's (None for ff)."""
        return self.rotary_style or self.arch.rotary

    @property
    def layer_unroll(self) -> int:
        """The layer loop's scan unroll: ``unroll``, or every layer when it is 0."""
        return self.unroll or self.n_layers

    @property
    def rot_dim(self) -> int:
        return self.rotary_dim or self.dim_per_head

    def inv_freq(self):
        """Rotary inverse frequencies [rot_dim / 2] (float64 numpy; ``model.rope``); global layers'."""
        return rope_inv_freq(self.rot_dim, self.rope_theta, self.rope_scaling) / (self.rope_linear or 1.0)

    @property
    def padded_vocab(self) -> int:
        """Rows of the embedding / columns of the head: vocab_size rounded up to vocab_multiple."""
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

    def replace(self, **changes) -> ModelConfig:
        return from_dict({**self.to_dict(), **changes})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


def _check_parts(cfg: ModelConfig) -> None:
    """Each part's fields, checked by the part (a bad one is one line naming the field)."""
    _check_plain_only(cfg), _check_moe(cfg), check_router(cfg), _check_dispatch(cfg), _remat_ok(cfg)
    check_lora(cfg), kinds.check_linear(cfg), check_mla(cfg), check_mtp(cfg), check_per_layer(cfg)
    check_quant(cfg)


def _check_attention(cfg: ModelConfig) -> None:
    if cfg.n_heads < 1:
        raise ConfigError(f"family {cfg.family!r} needs n_heads >= 1")
    if not cfg.head_dim and cfg.d_model % cfg.n_heads:
        raise ConfigError(f"d_model={cfg.d_model} is not divisible by n_heads={cfg.n_heads}")
    if cfg.n_heads % cfg.kv_heads:
        raise ConfigError(f"n_heads={cfg.n_heads} is not a multiple of n_kv_heads={cfg.kv_heads}")
    if cfg.rotary_style not in ("", "interleaved", "half"):
        raise ConfigError(f"rotary_style={cfg.rotary_style!r}; valid: interleaved, half")
    if cfg.rotary_dim % 2 or cfg.rotary_dim > cfg.dim_per_head:
        raise ConfigError(f"rotary_dim={cfg.rotary_dim} must be even and <= head_dim")
    if cfg.rope_local_theta and not cfg.global_every:
        raise ConfigError(f"rope_local_theta={cfg.rope_local_theta} needs global_every (local layers), or 0")
    if cfg.rope_scaling is not None and cfg.rope_linear:
        raise ConfigError("rope_scaling with rope_linear is not built; drop one")


def _check_kinds(cfg: ModelConfig) -> None:
    for name in ("global_every", "attn_scalar", "rope_local_theta", "rope_linear"):
        if getattr(cfg, name) and not cfg.arch.attention:
            raise ConfigError(f"{name}={getattr(cfg, name)} needs a family with attention; set {name}=0")


def _check_plain_only(cfg: ModelConfig) -> None:
    """What needs attention at all (windows and soft-capping run in every attention and --cp strategy)."""
    for name in ("sliding_window", "attn_softcap"):
        value = getattr(cfg, name)
        if value and not cfg.arch.attention:
            raise ConfigError(f"{name}={value} needs a family with attention; set {name}=0")


MOE_AUX_LOSSES = ("hf", "per-layer")  # ``model.moe.balance_loss``


def _check_moe(cfg: ModelConfig) -> None:
    if not cfg.arch.moe:
        sized = cfg.n_experts or cfg.experts_per_token or cfg.moe_d_ff or cfg.shared_expert_d_ff
        if sized or cfg.dense_layers or cfg.moe_capacity_factor or cfg.moe_aux_loss != MOE_AUX_LOSSES[0]:
            raise ConfigError(
                f"family {cfg.family!r} has a dense feed-forward; set n_experts, experts_per_token, "
                "moe_d_ff and shared_expert_d_ff to 0, dense_layers to [] and drop --moe-aux-loss and "
                "--moe-capacity-factor (or use a mixture-of-experts family: mixtral, qwen2_moe, qwen3_moe, "
                "olmoe)"
            )
        return
    if not (cfg.n_experts >= 1 and 1 <= cfg.experts_per_token <= cfg.n_experts and cfg.moe_d_ff >= 1):
        raise ConfigError(
            f"family {cfg.family!r} needs n_experts >= 1, 1 <= experts_per_token <= n_experts and "
            f"moe_d_ff >= 1; got {cfg.n_experts}, {cfg.experts_per_token}, {cfg.moe_d_ff}"
        )
    kinds.check_dense_layers(cfg)
    if cfg.moe_aux_loss not in MOE_AUX_LOSSES:
        raise ConfigError(f"moe_aux_loss is one of {', '.join(MOE_AUX_LOSSES)}; got {cfg.moe_aux_loss!r}")


def _check_dispatch(cfg: ModelConfig) -> None:
    if cfg.moe_dispatch not in DISPATCHES:
        raise ConfigError(f"moe_dispatch must be one of {', '.join(DISPATCHES)}, got {cfg.moe_dispatch!r}")
    parse_tiling(cfg.moe_gmm_tiling)  # "auto" or TM,TK,TN: one line naming the fix


# What each numeric field accepts; the others must just have their annotated type (str or bool).
RANGES: dict[str, Range] = {
    **dict.fromkeys(("vocab_size", "d_model", "n_layers", "d_ff", "max_seq_len"), POSITIVE_INT),
    "vocab_multiple": POSITIVE_INT,
    "n_heads": NON_NEGATIVE_INT,
    "n_kv_heads": Range(int, 0, note="0: n_heads"),
    "head_dim": Range(int, 0, note="0: d_model // n_heads"),
    "rotary_dim": Range(int, 0, note="0: head_dim"),
    "rope_theta": POSITIVE_FLOAT,
    "norm_eps": POSITIVE_FLOAT,
    "z_loss": NON_NEGATIVE_FLOAT,
    "unroll": Range(int, 0, note="0: all layers"),
    "attn_block": POSITIVE_INT,
    **LOSS_RANGES,
    "doc_mask": Range(int, -1, note="-1: off"),
    "sliding_window": Range(int, 0, note="0: off"),
    "attn_softcap": Range(float, 0, note="0: off"),
    "final_softcap": Range(float, 0, note="0: off"),
    "attn_scalar": Range(float, 0, note="0: head_dim"),
    "global_every": Range(int, 0, note="0: every layer alike"),
    "rope_local_theta": Range(float, 0, note="0: rope_theta"),
    "rope_linear": Range(float, 0, note="0: none"),
    "attn_chunk": Range(int, 0, note="0: off"),
    **dict.fromkeys(("attn_floor_scale", "attn_temp_scale"), Range(float, 0, note="0: off")),
    **dict.fromkeys(("n_experts", "experts_per_token", "moe_d_ff"), Range(int, 0, note="0: dense")),
    **MLA_RANGES,
    **MTP_RANGES,
    "shared_expert_d_ff": Range(int, 0, note="0: none"),
    "router_aux_loss_coef": NON_NEGATIVE_FLOAT,
    "router_z_loss_coef": NON_NEGATIVE_FLOAT,
    "moe_capacity_factor": Range(float, 0, note="0: dropless"),
    **ROUTER_RANGES,
    **LORA_RANGES,
    **kinds.LINEAR_RANGES,
    **PER_LAYER_RANGES,
}
_TYPES = {"str": (str, "a string"), "bool": (bool, "true or false")}


def _checked(name: str, kind: str, value: Any) -> Any:
    """``value`` as the plain int/float/str/bool field ``name`` holds, or a ConfigError naming
    the field, the value and what it must be (a config read from JSON may hold anything)."""
    if name in RANGES:
        if problem := RANGES[name].problem(name, value):
            raise ConfigError(problem)
        return int(value) if RANGES[name].kind is int else float(value)  # numpy scalars -> JSON-able
    want, noun = _TYPES[kind]
    if not isinstance(value, want):
        raise ConfigError(f"{name} must be {noun}, got {value!r}")
    return value


def field_names() -> list[str]:
    """ModelConfig's fields, its own first, then its bases' (layer kinds, experts): the order messages use."""
    names = [f.name for f in dataclasses.fields(ModelConfig)]
    bases = {f.name for base in ModelConfig.__bases__ for f in dataclasses.fields(base)}
    return [n for n in names if n not in bases] + [n for n in names if n in bases]


# A saved config without "vocab_multiple" predates vocabulary padding: its parameters are unpadded.
UNPADDED_BEFORE_FIELD = {"vocab_multiple": 1}


def from_dict(d: dict[str, Any]) -> ModelConfig:
    """Build a config from a dict (a saved one: see ``UNPADDED_BEFORE_FIELD``); unknown keys are an
    error listing the valid ones."""
    unknown = sorted(set(d) - set(field_names()))
    if unknown:
        raise ConfigError(f"unknown config field(s) {unknown}; valid: {', '.join(field_names())}")
    return ModelConfig(**{**UNPADDED_BEFORE_FIELD, **d})


def named_remat_blockers(cfg) -> list[str]:
    """What of ``cfg``'s layers has none of the names a named remat policy saves (empty: none)."""
    return [
        what
        for what, has in (
            ("MLA attention", cfg.kv_lora_rank > 0),
            ("linear-attention layers", bool(cfg.full_attn_every)),
            ("mixture-of-experts layers", cfg.n_experts > 0),
            ("no attention", not cfg.arch.attention),
        )
        if has
    ]


def _remat_ok(cfg) -> None:
    """A named remat policy saves what the plain attention and the dense MLP tag: a model whose layers
    compute their projections elsewhere would silently save nothing there (a full remat)."""
    if cfg.remat in NAMED_REMAT and (other := named_remat_blockers(cfg)):
        raise ConfigError(
            f"remat {cfg.remat!r} saves the q/k/v (and MLP input) projections of the standard attention "
            f"and dense MLP; this model has {', '.join(other)}: use none, full or selective"
        )


# The presets, every family's (its module in ``model.families``), in the order ``meshlm configs`` lists.
PRESETS: dict[str, ModelConfig] = {name: ModelConfig(**fields) for name, fields in preset_fields().items()}


def default_seq_len(cfg: ModelConfig, seq_len: int = 0) -> int:
    """``seq_len``, or when it is 0 every command's default: min(128, ``cfg.max_seq_len``)
    (``meshlm.settings.DEFAULT_SEQ_LEN``)."""
    from meshlm.settings import DEFAULT_SEQ_LEN

    return seq_len or min(DEFAULT_SEQ_LEN, cfg.max_seq_len)


def beyond_max_seq_len(cfg: ModelConfig, seq_len: int, name: str = "model") -> str | None:
    """A note when ``seq_len`` exceeds ``cfg.max_seq_len`` on a rotary model (the limit is then the
    configuration's, not a learned position table's: accepted); an error where positions are learned."""
    if seq_len <= cfg.max_seq_len:
        return None
    if cfg.arch.attention and cfg.arch.rotary is None:
        raise ConfigError(
            f"seq_len={seq_len} exceeds the {name} config's max_seq_len={cfg.max_seq_len}; "
            f"use --seq-len {cfg.max_seq_len} or less"
        )
    return (
        f"note: --seq-len {seq_len} is above the {name} config's max_seq_len={cfg.max_seq_len}: accepted, "
        "rotary positions have no learned table (quality beyond the trained length is not guaranteed)"
    )


def get_config(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown config {name!r}; valid: {', '.join(PRESETS)}")
    return PRESETS[name]
