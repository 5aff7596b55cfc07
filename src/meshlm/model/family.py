"""``Family``: one record per block family, the facts the rest of meshlm looks up instead of branching.

The model (``transformer``), the rules table, the collective minimum (``perf.collectives``,
``perf.memory_collectives``, the proof's communication check), the planner's activation estimate,
the hand-written benchmark reference and the Hugging Face converter all read a family's facts here.
What a family computes is its layer code (``transformer.BLOCKS``, named by ``block``); a new family
is one record here plus, only if its blocks are new, their layer code (and for conversion its
``HFNames`` and the converter's config reader and writer, ``io.hf_config``).

This module must not import JAX: configs are validated (and the CLI built) before devices exist.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

# Per-layer recomputation policies (``model.memory`` says what each keeps); every family has all three.
REMAT = ("none", "full", "selective")
# Compute dtypes of a train step: float32, or bf16 compute with float32 master weights.
COMPUTE_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class HFNames:
    """How transformers spells a family: its config and its tensors (``io.hf_config``, ``io.hf_weights``).

    Tensor maps: our path -> (HF name, layout), layouts "copy" (same array), "linear" (torch [out, in]
    <-> ours [in, out]), "q" / "kv" ([heads*E, D] <-> [D, heads, E]), "o" ([D, H*E] <-> [H, E, D]) and
    "heads" (a head projection's bias: [heads*E] <-> [heads, E]).
    """

    architecture: str  # config.json "architectures"
    activation_key: str  # the config field naming the MLP activation
    activations: tuple[str, ...]  # its values that name the very function meshlm computes (first: ours)
    dropout_fields: tuple[str, ...]  # must be 0: meshlm trains without dropout
    top: dict = field(default_factory=dict)  # tensors outside the layer stack
    layer: dict = field(default_factory=dict)  # tensors of one layer, under ``layer_prefix``
    layer_prefix: str = ""  # e.g. "model.layers.{i}."


@dataclass(frozen=True)
class Family:
    name: str  # ModelConfig.family
    block: str  # the layer code (``transformer.BLOCKS``): "ff", "parallel" or "sequential"
    attention: bool  # heads, positions and a KV cache; False: the prototype's feed-forward stack
    rotary: str | None  # the rotary convention transformers uses for it: "interleaved", "half" (None: none)
    # "layer" (LayerNorm), "rms" (RMSNorm) or "rms_plus_one" (Gemma's: times 1 + w, w starting at 0)
    # before each branch and at the end
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

    def per_layer_text(self) -> str:
        """The minimum's per-layer all-reduces, as the communication check words them."""
        return f"{self.row_sums} forward, {self.row_sums} backward"


GPTJ_HF = HFNames(
    architecture="GPTJForCausalLM",
    activation_key="activation_function",
    activations=("gelu_new", "gelu_pytorch_tanh"),
    dropout_fields=("resid_pdrop", "embd_pdrop", "attn_pdrop"),
    top={
        "embed/embeddings": ("transformer.wte.weight", "copy"),
        "final_ln/scale": ("transformer.ln_f.weight", "copy"),
        "final_ln/offset": ("transformer.ln_f.bias", "copy"),
        "head/w": ("lm_head.weight", "linear"),
        "head/b": ("lm_head.bias", "copy"),
    },
    layer={
        "ln/scale": ("ln_1.weight", "copy"),
        "ln/offset": ("ln_1.bias", "copy"),
        "attn/wq": ("attn.q_proj.weight", "q"),
        "attn/wk": ("attn.k_proj.weight", "kv"),
        "attn/wv": ("attn.v_proj.weight", "kv"),
        "attn/wo": ("attn.out_proj.weight", "o"),
        "mlp/w_in": ("mlp.fc_in.weight", "linear"),
        "mlp/b_in": ("mlp.fc_in.bias", "copy"),
        "mlp/w_out": ("mlp.fc_out.weight", "linear"),
        "mlp/b_out": ("mlp.fc_out.bias", "copy"),
    },
    layer_prefix="transformer.h.{i}.",
)
LLAMA_HF = HFNames(
    architecture="LlamaForCausalLM",
    activation_key="hidden_act",
    activations=("silu", "swish"),
    dropout_fields=("attention_dropout",),
    top={
        "embed/embeddings": ("model.embed_tokens.weight", "copy"),
        "final_ln/scale": ("model.norm.weight", "copy"),
        "head/w": ("lm_head.weight", "linear"),
    },
    layer={
        "ln/scale": ("input_layernorm.weight", "copy"),
        "ln2/scale": ("post_attention_layernorm.weight", "copy"),
        "attn/wq": ("self_attn.q_proj.weight", "q"),
        "attn/wk": ("self_attn.k_proj.weight", "kv"),
        "attn/wv": ("self_attn.v_proj.weight", "kv"),
        "attn/wo": ("self_attn.o_proj.weight", "o"),
        "mlp/w_gate": ("mlp.gate_proj.weight", "linear"),
        "mlp/w_up": ("mlp.up_proj.weight", "linear"),
        "mlp/w_down": ("mlp.down_proj.weight", "linear"),
    },
    layer_prefix="model.layers.{i}.",
)
# Mistral's tensors are Llama's; its config adds ``sliding_window`` (``ModelConfig.sliding_window``).
MISTRAL_HF = replace(LLAMA_HF, architecture="MistralForCausalLM")
# Gemma's tensors are Llama's too; its config's activation is tanh GELU ("gelu" is transformers'
# legacy spelling of the same: GemmaConfig turns it into "gelu_pytorch_tanh").
GEMMA_HF = replace(
    LLAMA_HF,
    architecture="GemmaForCausalLM",
    activations=("gelu_pytorch_tanh", "gelu"),
)

# Qwen2 / Qwen2.5: Llama's tensors plus q/k/v biases ("heads": ours [heads, E] <-> HF [heads*E]).
QWEN2_HF = HFNames(
    architecture="Qwen2ForCausalLM",
    activation_key="hidden_act",
    activations=("silu", "swish"),
    dropout_fields=("attention_dropout",),
    top=LLAMA_HF.top,
    layer={
        **LLAMA_HF.layer,
        "attn/bq": ("self_attn.q_proj.bias", "heads"),
        "attn/bk": ("self_attn.k_proj.bias", "heads"),
        "attn/bv": ("self_attn.v_proj.bias", "heads"),
    },
    layer_prefix=LLAMA_HF.layer_prefix,
)

# RMSNorm; sequential pre-norm attention then SwiGLU MLP: two all-reduces per layer. The newer
# families below are Llama's blocks with one or two facts changed.
LLAMA = Family(
    name="llama",
    block="sequential",
    attention=True,
    rotary="half",
    norm="rms",
    mlp="swiglu",
    biases=False,
    row_sums=2,
    gpt_init=True,
    hf=LLAMA_HF,
)

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        # The prototype: embedding (+bias), residual 4x-GELU feed-forward blocks, vocabulary projection.
        Family(
            name="ff",
            block="ff",
            attention=False,
            rotary=None,
            norm=None,
            mlp="gelu",
            biases=True,
            row_sums=1,
            gpt_init=False,
        ),
        # LayerNorm; attention and MLP in parallel off one norm: one all-reduce per layer forward.
        Family(
            name="gptj",
            block="parallel",
            attention=True,
            rotary="interleaved",
            norm="layer",
            mlp="gelu",
            biases=True,
            row_sums=1,
            gpt_init=True,
            hf=GPTJ_HF,
        ),
        LLAMA,
        # Llama's blocks with biases on q/k/v (column-parallel: sliced with their heads).
        replace(LLAMA, name="qwen2", hf=QWEN2_HF, qkv_bias=True),
        # Llama's blocks; what differs is in its config: a sliding attention window (none on v0.3).
        replace(LLAMA, name="mistral", hf=MISTRAL_HF),
        # Gemma 1: sequential blocks, GeGLU MLP, RMSNorm times (1 + w), embeddings times sqrt(d_model),
        # a tied head (its presets), head_dim 256 whatever d_model / n_heads.
        replace(LLAMA, name="gemma", norm="rms_plus_one", mlp="geglu", hf=GEMMA_HF, embed_scale=True),
    )
}
