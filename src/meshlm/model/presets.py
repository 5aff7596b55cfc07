"""Presets of today's Hugging Face families (Llama 3.x, Qwen2.5): tiny ones for the proof, real ones
for ``plan`` and ``memory``. Plain keyword dicts (``model.config`` builds the ``ModelConfig``s and adds
them to ``PRESETS``), so this module imports no config and no JAX.

Real shapes are those of the published config.json files (meta-llama/Meta-Llama-3-8B,
meta-llama/Llama-3.1-70B, Qwen/Qwen2.5-7B); their vocabularies are multiples of 128 (no padding).
"""

from __future__ import annotations

from meshlm.model.rope import RopeScaling

# Llama 3.1's rope_scaling (factor 8 over its 8192-token pretraining context).
LLAMA31_SCALING = RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)
_TINY = dict(vocab_size=64, d_model=64, n_layers=2, d_ff=128, n_heads=8, max_seq_len=64, norm_eps=1e-6)

FAMILY_PRESETS: dict[str, dict] = {
    # Llama 3.2-style: tied embeddings, 2 KV heads (replicated on mp = 4), and Llama 3.1's frequency
    # scaling over an original context of 16, so that with head_dim 8 one frequency is interpolated
    # and three are divided by the factor (none kept): every branch of the formula is in play.
    "tiny-llama3": dict(
        _TINY,
        family="llama",
        n_kv_heads=2,
        rope_theta=500000.0,
        tie_embeddings=True,
        rope_scaling=RopeScaling(
            factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16
        ),
    ),
    # Qwen2.5-0.5B-style: q/k/v biases, 2 KV heads, tied embeddings, rope_theta 1e6.
    "tiny-qwen2": dict(_TINY, family="qwen2", n_kv_heads=2, rope_theta=1e6, tie_embeddings=True),
    "llama3-8b": dict(
        family="llama",
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
        family="llama",
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
    "qwen2.5-7b": dict(
        family="qwen2",
        vocab_size=152064,
        d_model=3584,
        n_layers=28,
        d_ff=18944,
        n_heads=28,
        n_kv_heads=4,
        rope_theta=1e6,
        max_seq_len=131072,
        norm_eps=1e-6,
    ),
}
