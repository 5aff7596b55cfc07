"""``Family``: one record per block family, the facts the rest of meshlm looks up instead of branching.

The model (``transformer``), the rules table, the collective minimum (``perf.collectives``,
``perf.memory_collectives``, the proof's communication check), the planner's activation estimate,
the hand-written benchmark reference and the Hugging Face converter all read a family's facts here.
What a family computes is its layer code (``transformer.BLOCKS``, named by ``block``). Each family is
one module of ``model.families`` (its record, its ``HFNames`` with the config.json reader and writer,
its presets), listed once in that package's registry; a new family is one such module plus one
registry line (and layer code only if its blocks are new).

This module must not import JAX: configs are validated (and the CLI built) before devices exist.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Per-layer recomputation policies (``model.memory`` says what each keeps); every family has all three.
REMAT = ("none", "full", "selective", "save_qkv_proj", "save_qkv_mlp_in", "save_qkv_attn")
# The policies that save named activations (``jax.ad_checkpoint.checkpoint_name`` in the attention and
# the dense MLP; ``model.memory``): a layer without those names (MLA, linear attention, experts) has none
NAMED_REMAT = ("save_qkv_proj", "save_qkv_mlp_in", "save_qkv_attn")
# Compute dtypes of a train step: float32, or bf16 compute with float32 master weights.
COMPUTE_DTYPES = ("float32", "bfloat16")
# LoRA's target names (``--lora-targets``) -> the "module/param" each names in a family's blocks
# (``Family.lora_targets``; ``model.lora``).
LORA_ATTENTION = {"q": "attn/wq", "k": "attn/wk", "v": "attn/wv", "o": "attn/wo"}
LORA_GATED = {**LORA_ATTENTION, "gate": "mlp/w_gate", "up": "mlp/w_up", "down": "mlp/w_down"}
LORA_GELU = {**LORA_ATTENTION, "up": "mlp/w_in", "down": "mlp/w_out"}


@dataclass(frozen=True)
class HFNames:
    """How transformers spells a family: its config and its tensors (``io.hf_config``, ``io.hf_weights``).

    ``read``, ``write`` and ``check_export`` translate config.json as plain dicts (no files: the
    model package imports no ``io``): ``read(hf)`` -> the ``ModelConfig`` fields but ``family``;
    ``write(cfg)`` -> the family's config.json fields; ``check_export(cfg)`` raises a ``ConfigError``
    when transformers cannot express ``cfg``. ``io.hf_config`` adds what every family shares.

    Tensor maps: our path -> (HF name, layout), layouts "copy" (same array), "linear" (torch [out, in]
    <-> ours [in, out]), "q" / "kv" ([heads*E, D] <-> [D, heads, E]), "o" ([D, H*E] <-> [H, E, D]),
    "heads" (a head projection's bias: [heads*E] <-> [heads, E]) and "fused_<layout>" (one row slice
    of an HF tensor several of our parameters share, as Phi-3's qkv_proj: the slices in map order).
    """

    model_type: str  # config.json "model_type"
    architecture: str  # config.json "architectures"
    activation_key: str  # the config field naming the MLP activation
    activations: tuple[str, ...]  # its values that name the very function meshlm computes (first: ours)
    dropout_fields: tuple[str, ...]  # must be 0: meshlm trains without dropout
    read: Callable[[dict], dict[str, Any]]  # config.json -> ModelConfig fields (all but "family")
    write: Callable[[Any], dict[str, Any]]  # ModelConfig -> the family's config.json fields
    check_export: Callable[[Any], None]  # raises ConfigError where transformers cannot express cfg
    top: dict = field(default_factory=dict)  # tensors outside the layer stack
    layer: dict = field(default_factory=dict)  # tensors of one layer, under ``layer_prefix``
    layer_prefix: str = ""  # e.g. "model.layers.{i}."
    # A mixture of experts: layer tensors per expert are named with "{e}" (layout "experts": [E, out,
    # in] <-> ours [E, in, out]); ``fused``: transformers 5's in-memory names -> the per-expert names
    # each concatenates along dim 1 (``io.hf_experts``), or a plain rename (one name without "{e}").
    fused: dict = field(default_factory=dict)
    # Whether transformers also reads only the ``fused`` names from disk (Gemma 4: no per-expert loader):
    # written fused (``io.hf_experts.fuse``); else the per-expert ones
    fused_on_disk: bool = False
    # (cfg, tensors, to_hf) -> None: a family whose fused tensors interleave their parts per head group
    # (Qwen3-Next's in_proj_qkvz) reorders their rows in ``tensors`` (per-layer HF names -> arrays) into
    # the parts one after another, as "fused_<layout>" slices them (to_hf: back); None: none do.
    regroup: Callable | None = None
    # transformers' tensors whose last dim interleaves several of the names ``layer`` maps (gpt-oss's
    # ``gate_up_proj``: gate at the even columns, up at the odd): name -> those names (``io.hf_experts``)
    interleaved: dict = field(default_factory=dict)
    # ... whose last dim holds several of them one after another (Llama 4's ``gate_up_proj``: gate, up)
    concatenated: dict = field(default_factory=dict)
    # cfg -> transformers' per-layer tensor names some layers lack (Gemma 4's shared layers' k/v): our
    # stacked parameter is zeros there on import (never read) and the name is not written on export.
    absent: Callable | None = None


@dataclass(frozen=True)
class Family:
    name: str  # ModelConfig.family
    # the layer code (``transformer.BLOCKS``): "ff", "parallel", "sequential", "post_norm" (OLMo 2:
    # x + norm(attn(x)), then x + norm(mlp(x)); no norm on a branch's input) or "sandwich" (Gemma 2/3:
    # x + norm(attn(norm(x))), then x + norm(mlp(norm(x))))
    block: str
    attention: bool  # heads, positions and a KV cache; False: the prototype's feed-forward stack
    rotary: str | None  # the rotary convention transformers uses for it: "interleaved", "half" (None: none)
    # "layer" (LayerNorm), "rms" (RMSNorm), "rms_plus_one" (Gemma's: times 1 + w, w starting at 0) or
    # "rms_product_first" (OLMo 2's: the weight product in float32 before the cast), on each branch
    # and at the end
    norm: str | None
    mlp: str  # "gelu", "swiglu" or "geglu" (gated, tanh GELU: Gemma)
    biases: bool  # MLP and output-projection biases (the MLP's output bias is a row-parallel bias)
    # Row-parallel sums per layer = entries into column-parallel regions (``par.row_out`` / ``par.f``):
    # a parallel block sums attention and MLP in one, a sequential block needs one per branch.
    row_sums: int
    gpt_init: bool  # GPT-J / Llama initialisation (stddev 0.02); False: the prototype's 1/sqrt(fan-in)
    hf: HFNames | None = None  # transformers' names; None: no transformers equivalent
    remat: tuple[str, ...] = REMAT  # the recomputation policies its blocks support
    compute_dtypes: tuple[str, ...] = COMPUTE_DTYPES  # the compute dtypes it trains in
    embed_scale: bool = False  # embeddings multiplied by sqrt(d_model) (Gemma; in the embedding dtype)
    # Biases on the q/k/v projections (Qwen2): column-parallel, sharded with their heads (the KV
    # biases replicated and sliced with their heads where the KV heads are); no output-projection bias.
    qkv_bias: bool = False
    # A bias on the attention's output projection (gpt-oss: with ``qkv_bias``, transformers'
    # ``attention_bias``): [D] replicated, added once (on mp shard 0's partial, before the row sum).
    o_bias: bool = False
    # The local (windowed) layers' rotary is the global ones', scaling included (gpt-oss: one rotary
    # for every layer); False: plain RoPE of ``rope_local_theta`` there (Gemma 3, OLMo 3).
    rope_scales_local: bool = False
    # RMSNorm of the queries and keys before rotary: "head" (Qwen3: over each head's E, weights [E]
    # shared by the heads, replicated; their gradient summed over mp, where the heads are split) or
    # "proj" (OLMo 2: over the whole projection, H*E or K*E, weights [H, E] / [K, E] split with the
    # heads; its mean square gathered over mp) or "head_plus_one" (Gemma 3: as "head", times (1 + w)).
    # None: none.
    qk_norm: str | None = None
    # The feed-forward is a mixture of experts (``model.moe``: a router, top-k of ``n_experts`` gated
    # MLPs; ``ModelConfig``'s MoE fields size it); False: the dense MLP.
    moe: bool = False
    # LoRA's target names -> parameter paths (``LORA_GATED``...); a mixture of experts' MLP names are
    # its dense MLP's, which its MoE layers lack: there only the attention's apply (``model.lora_fields``)
    lora_targets: dict = field(default_factory=dict)
    # Qwen3.5's gated attention: the query projection gives each head's query and an output gate g
    # ([D, H, 2E]: transformers' q_proj, per head), the head's output times sigmoid(g) before ``wo``.
    attn_gate: bool = False

    def per_layer_text(self) -> str:
        """The minimum's per-layer all-reduces, as the communication check words them."""
        moe = " + 1 backward: the MoE combine weights" if self.moe else ""
        return f"{self.row_sums} forward, {self.row_sums} backward{moe}"
