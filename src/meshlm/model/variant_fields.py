"""``ModelConfig``'s attention-variant fields of the third families pass (a base, as ``MoEFields``): which
layers rotate, and what joins a layer's softmax. Each is read by ``attention_variants.Variant`` or by the
layer kinds' tables (``attention.kind_tables``); no kernel reads them.

This module must not import JAX: configs are validated before devices exist.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshlm.errors import ConfigError


@dataclass(frozen=True)
class VariantFields:
    """The attention variants' config fields (absent from a saved config: off, as it was)."""

    # The global layers (every ``global_every``-th) are not rotated: NoPE (SmolLM3's ``no_rope_layers``),
    # their kind's rotary frequencies zero (``attention.kind_tables``: the rotation is then the identity,
    # exactly: cos 0 = 1, sin 0 = 0). False: every layer rotated.
    global_nope: bool = False
    # Learned attention sinks (gpt-oss): a logit per query head joins each softmax's normaliser
    # (``attention_variants.Variant.finish``), the parameter "attn/sinks" [H] of every layer. False: none.
    attn_sinks: bool = False
    # Chunked attention (Llama 4's ``attention_chunk_size``): a query sees only the keys of its chunk of
    # this many positions (``attention_variants.mask_mod``), on every layer, or with layer kinds on the
    # local ones (the global ones see the whole context). 0: off.
    attn_chunk: int = 0


def check_variant_fields(cfg) -> None:
    """The variant fields agree with the rest of the config (``cfg`` a ``ModelConfig``)."""
    if cfg.attn_chunk and (not cfg.arch.attention or cfg.sliding_window):
        raise ConfigError("attn_chunk needs a family with attention and no sliding_window (one local rule)")
    if cfg.attn_sinks and not cfg.arch.attention:
        raise ConfigError("attn_sinks=true needs a family with attention; set attn_sinks=false")
    if cfg.global_nope and not (cfg.arch.attention and cfg.global_every):
        raise ConfigError(
            "global_nope=true needs global layers: set global_every (every N-th layer NoPE), or false"
        )
