"""GPT-J: LayerNorm; attention and MLP in parallel off one norm (one all-reduce per layer forward);
GELU MLP with biases; rotary interleaved over the first ``rotary_dim`` dims of each head; an untied
head with a bias.

transformers' GPT-J rotates interleaved pairs (x0, x1), (x2, x3), ... over the first ``rotary_dim``
dims of each head (``rotate_every_two``), base 10000: meshlm's "interleaved" style does the same, so
its weights map by transpose and reshape only (``io.hf_weights``).
"""

from __future__ import annotations

from typing import Any

from meshlm.errors import ConfigError
from meshlm.model.families.hf_fields import (
    POSITIVE,
    SIZE,
    check_heads,
    field,
    flag,
    plain_rope_theta,
    unsupported,
)
from meshlm.model.family import LORA_GELU, Family, HFNames

ROPE_THETA = 10000.0  # hard-coded in transformers' GPT-J
_DROPOUT_FIELDS = ("resid_pdrop", "embd_pdrop", "attn_pdrop")


def read(hf: dict) -> dict[str, Any]:
    """GPTJConfig's fields -> ours."""
    d, heads = field(hf, "n_embd", SIZE), field(hf, "n_head", SIZE)
    if flag(hf, "tie_word_embeddings"):
        raise unsupported("tie_word_embeddings", True, "meshlm's gptj head is untied (it has a bias)")
    if "rotary_dim" in hf and hf["rotary_dim"] is None:
        raise unsupported("rotary_dim", None, "set rotary_dim to the number of rotated dims per head")
    theta = plain_rope_theta(hf, "GPT-J")
    if theta != ROPE_THETA:
        raise unsupported("rope_theta", theta, f"transformers' GPT-J always uses {ROPE_THETA}")
    per_head = check_heads(d, heads, ("n_embd", "n_head"), None)
    rotary = field(hf, "rotary_dim", SIZE, 64)
    if rotary % 2 or rotary > per_head:
        raise ConfigError(f"HF config rotary_dim={rotary} must be even and <= n_embd/n_head={per_head}")
    return dict(
        vocab_size=field(hf, "vocab_size", SIZE),
        d_model=d,
        n_layers=field(hf, "n_layer", SIZE),
        d_ff=field(hf, "n_inner", SIZE, 4 * d, nullable=True),  # HF: n_inner None means 4 * n_embd
        n_heads=heads,
        rotary_dim=0 if rotary == per_head else rotary,  # 0 = the whole head, our canonical form
        max_seq_len=field(hf, "n_positions", SIZE, 2048),
        norm_eps=float(field(hf, "layer_norm_epsilon", POSITIVE, 1e-5)),
    )


def check_export(cfg) -> None:
    if cfg.tie_embeddings or cfg.kv_heads != cfg.n_heads or cfg.dim_per_head * cfg.n_heads != cfg.d_model:
        raise ConfigError(
            "transformers' GPT-J needs tie_embeddings=False, n_kv_heads=n_heads and "
            f"head_dim=d_model/n_heads; got {cfg.tie_embeddings}, {cfg.kv_heads}, {cfg.dim_per_head}"
        )
    if cfg.rope_theta != ROPE_THETA:
        raise ConfigError(f"rope_theta={cfg.rope_theta}: transformers' GPT-J uses {ROPE_THETA}")


def write(cfg) -> dict[str, Any]:
    return {
        **{k: 0.0 for k in _DROPOUT_FIELDS},
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layers,
        "n_head": cfg.n_heads,
        "n_inner": cfg.d_ff,
        "rotary_dim": cfg.rot_dim,
        "n_positions": cfg.max_seq_len,
        "layer_norm_epsilon": cfg.norm_eps,
        "activation_function": "gelu_new",
    }


HF = HFNames(
    model_type="gptj",
    architecture="GPTJForCausalLM",
    activation_key="activation_function",
    activations=("gelu_new", "gelu_pytorch_tanh"),
    dropout_fields=_DROPOUT_FIELDS,
    read=read,
    write=write,
    check_export=check_export,
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

FAMILY = Family(
    name="gptj",
    block="parallel",
    attention=True,
    rotary="interleaved",
    norm="layer",
    mlp="gelu",
    biases=True,
    row_sums=1,
    gpt_init=True,
    hf=HF,
    lora_targets=LORA_GELU,
)

TINY = dict(vocab_size=64, d_model=64, n_layers=2, d_ff=256, n_heads=8, rotary_dim=4, max_seq_len=64)
# ``ModelConfig`` fields by preset name (the registry adds ``family``).
PRESETS: dict[str, dict] = {
    "tiny-gptj": TINY,
    # Real shapes (not trained here; verify and memory reports accept them).
    "gptj-6b": dict(
        vocab_size=50400,
        d_model=4096,
        n_layers=28,
        d_ff=16384,
        n_heads=16,
        rotary_dim=64,
        max_seq_len=2048,
    ),
    # GPT-2's vocabulary (50257, prime to every mp > 1), padded to 50304: the padding proven on
    # mp = 2, 4, 8.
    "tiny-gpt2vocab": dict(TINY, vocab_size=50257, d_model=32, d_ff=64),
}
