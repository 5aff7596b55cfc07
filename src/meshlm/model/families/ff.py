"""The prototype's family: embedding (+bias), residual 4x-GELU feed-forward blocks, vocabulary
projection. No attention and no transformers equivalent."""

from __future__ import annotations

from meshlm.model.family import Family

FAMILY = Family(
    name="ff",
    block="ff",
    attention=False,
    rotary=None,
    norm=None,
    mlp="gelu",
    biases=True,
    row_sums=1,
    gpt_init=False,
)

# ``ModelConfig`` fields by preset name (the registry adds ``family``).
PRESETS: dict[str, dict] = {
    # The prototype exactly: byte vocab, width 128, two residual 4x-GELU feed-forward blocks.
    "seed": dict(vocab_size=256, d_model=128, n_layers=2, d_ff=512, embed_bias=True),
    # Small enough for tests on 8 fake devices (every dim divisible by 8).
    "tiny": dict(vocab_size=64, d_model=32, n_layers=2, d_ff=128, embed_bias=True),
}
