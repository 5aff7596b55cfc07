"""Llama (2 and 3.x): RMSNorm; sequential pre-norm attention then SwiGLU MLP (two all-reduces per
layer); no biases; rotary rotate-half over the whole head; grouped-query attention; optional tied
embeddings. Llama 3.x is this family with two config facts: ``rope_scaling`` and (3.2 1B/3B)
``tie_embeddings``. Qwen2, Mistral and Gemma are its blocks with one or two facts changed: their
modules start from ``FAMILY``, ``HF``, ``read`` and ``write`` here.

transformers' Llama q/k weights are stored for ``rotate_half`` (Meta's permutation is undone when a
Meta checkpoint is converted to HF format): meshlm's "half" style is rotate_half over the whole head,
so weights map by transpose and reshape only (``io.hf_weights``).
"""

from __future__ import annotations

from typing import Any

from meshlm.errors import ConfigError
from meshlm.model.families.hf_fields import POSITIVE, SIZE, check_heads, field, flag, rope, rope_fields
from meshlm.model.family import LORA_GATED, Family, HFNames
from meshlm.model.rope import RopeScaling


def read(hf: dict) -> dict[str, Any]:
    """LlamaConfig's fields -> ours (also the base of Qwen2's, Mistral's and Gemma's)."""
    d, heads = field(hf, "hidden_size", SIZE), field(hf, "num_attention_heads", SIZE)
    kv = field(hf, "num_key_value_heads", SIZE, heads, nullable=True)
    if heads % kv:
        raise ConfigError(
            f"HF config num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}; "
            "correct config.json"
        )
    head_dim = field(hf, "head_dim", SIZE, None, nullable=True)
    head_dim = check_heads(d, heads, ("hidden_size", "num_attention_heads"), head_dim)
    theta, scaling = rope(hf)
    return dict(
        vocab_size=field(hf, "vocab_size", SIZE),
        d_model=d,
        n_layers=field(hf, "num_hidden_layers", SIZE),
        d_ff=field(hf, "intermediate_size", SIZE),
        n_heads=heads,
        n_kv_heads=0 if kv == heads else kv,  # 0 = n_heads, our canonical form
        head_dim=0 if d % heads == 0 and head_dim == d // heads else head_dim,
        rope_theta=theta,
        rope_scaling=scaling,
        max_seq_len=field(hf, "max_position_embeddings", SIZE, 2048),
        norm_eps=float(field(hf, "rms_norm_eps", POSITIVE, 1e-6)),
        tie_embeddings=flag(hf, "tie_word_embeddings"),
    )


def check_export(cfg) -> None:
    if cfg.rot_dim != cfg.dim_per_head:
        raise ConfigError(f"rotary_dim={cfg.rotary_dim}: transformers' Llama rotates the whole head")


def write(cfg) -> dict[str, Any]:
    return {
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.dim_per_head,
        "intermediate_size": cfg.d_ff,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "rope_parameters": rope_fields(cfg),
        "rope_theta": cfg.rope_theta,  # where transformers 4.x reads it
        **({"rope_scaling": rope_fields(cfg)} if cfg.rope_scaling else {}),  # and its scaling
    }


HF = HFNames(
    model_type="llama",
    architecture="LlamaForCausalLM",
    activation_key="hidden_act",
    activations=("silu", "swish"),
    dropout_fields=("attention_dropout",),
    read=read,
    write=write,
    check_export=check_export,
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

FAMILY = Family(
    name="llama",
    block="sequential",
    attention=True,
    rotary="half",
    norm="rms",
    mlp="swiglu",
    biases=False,
    row_sums=2,
    gpt_init=True,
    hf=HF,
    lora_targets=LORA_GATED,
)

# Llama 3.1's rope_scaling (factor 8 over its 8192-token pretraining context).
LLAMA31_SCALING = RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)
# The tiny shape the families' proof presets share.
TINY = dict(vocab_size=64, d_model=64, n_layers=2, d_ff=128, n_heads=8, max_seq_len=64, norm_eps=1e-6)
# n_kv_heads=4 < n_heads: grouped-query attention; on mp=8 the KV heads are replicated.
TINY_LLAMA = dict(TINY, n_kv_heads=4)
LLAMA2_7B = dict(
    vocab_size=32000, d_model=4096, n_layers=32, d_ff=11008, n_heads=32, max_seq_len=4096, norm_eps=1e-5
)
_BYTES = dict(vocab_size=256, d_model=64, n_layers=2, d_ff=128, n_heads=4, max_seq_len=64, norm_eps=1e-6)

# ``ModelConfig`` fields by preset name (the registry adds ``family``). Real shapes are those of the
# published config.json files (meta-llama/Llama-2-7b, Meta-Llama-3-8B, Llama-3.1-70B); the Llama 3
# vocabulary is a multiple of 128 (no padding).
PRESETS: dict[str, dict] = {
    "tiny-llama": TINY_LLAMA,
    # A byte-level transformer small enough for training tests.
    "tiny-lm": _BYTES,
    # What CPU training defaults to: about 3.2M parameters, trains visibly in minutes on 2 cores.
    "cpu": dict(_BYTES, d_model=256, n_layers=4, d_ff=768, n_heads=8, max_seq_len=128),
    # The cpu model with 8 layers: a pipeline's per-tick work dominates its fixed costs (bench --pp).
    "cpu-deep": dict(_BYTES, d_model=256, n_layers=8, d_ff=768, n_heads=8, max_seq_len=128),
    "small": dict(_BYTES, d_model=512, n_layers=8, d_ff=1536, n_heads=8, max_seq_len=256),
    "llama2-7b": LLAMA2_7B,
    # Llama 3.2-style: tied embeddings, 2 KV heads (replicated on mp = 4), and Llama 3.1's frequency
    # scaling over an original context of 16, so that with head_dim 8 one frequency is interpolated
    # and three are divided by the factor (none kept): every branch of the formula is in play.
    "tiny-llama3": dict(
        TINY,
        n_kv_heads=2,
        rope_theta=500000.0,
        tie_embeddings=True,
        rope_scaling=RopeScaling(
            factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16
        ),
    ),
    "llama3-8b": dict(
        vocab_size=128256,
        d_model=4096,
        n_layers=32,
        d_ff=14336,
        n_heads=32,
        n_kv_heads=8,
        rope_theta=500000.0,
        max_seq_len=8192,
        norm_eps=1e-5,
    ),
    "llama3.1-70b": dict(
        vocab_size=128256,
        d_model=8192,
        n_layers=80,
        d_ff=28672,
        n_heads=64,
        n_kv_heads=8,
        rope_theta=500000.0,
        rope_scaling=LLAMA31_SCALING,
        max_seq_len=131072,
        norm_eps=1e-5,
    ),
    # meta-llama/Llama-3.2-1B's config.json: Llama 3.1's frequency scaling with factor 32 over 8192,
    # tied embeddings (its bos 128000 and eos 128001 are the tokenizer's, not the model's). A model
    # that fills one 16 GiB chip (docs/memory.md).
    "llama3.2-1b": dict(
        vocab_size=128256,
        d_model=2048,
        n_layers=16,
        d_ff=8192,
        n_heads=32,
        n_kv_heads=8,
        head_dim=64,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(
            factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
        ),
        max_seq_len=131072,
        norm_eps=1e-5,
        tie_embeddings=True,
    ),
    # HuggingFaceTB/SmolLM2-360M's config.json (a Llama): 15 heads of 64 and 5 KV heads, tied.
    "smollm2-360m": dict(
        vocab_size=49152,
        d_model=960,
        n_layers=32,
        d_ff=2560,
        n_heads=15,
        n_kv_heads=5,
        head_dim=64,
        rope_theta=100000.0,
        max_seq_len=8192,
        norm_eps=1e-5,
        tie_embeddings=True,
    ),
    # the chip's bench model (docs/benchmarks.md, "On a TPU chip"): the shape issue 56 measured meshlm
    # against plain JAX on (a GPT-2-small-sized Llama of 8 layers, ~100M parameters; fits one 16 GiB chip
    # in float32 with AdamW at 8 x 512 without remat, and at 2 x 8192 with blockwise or flash attention)
    "llama-100m": dict(
        vocab_size=16384,
        d_model=768,
        n_layers=8,
        d_ff=3072,
        n_heads=12,
        max_seq_len=8192,
        norm_eps=1e-5,
    ),
    # tiny-llama with 8 layers: pipelines of pp = 4 and interleaved schedules (pp x V chunks) on 4-8
    # devices.
    "tiny-deep": dict(TINY_LLAMA, n_layers=8),
    # Grouped-query attention with 2 KV heads: on mp = 4 (or 8) the KV heads are replicated, so the
    # replication path is proven on the 4 devices of a laptop, not only on 8.
    "tiny-gqa": dict(TINY_LLAMA, n_kv_heads=2),
}
