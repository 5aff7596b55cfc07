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
    # Llama 4's L2 norm of each rotated query and key head after its rotary (``use_qk_norm``: no weight,
    # eps ``norm_eps``), on the rotated layers only (``attention_variants.Variant.queries``). False: none.
    qk_l2_norm: bool = False
    # Llama 4's attention temperature on the NoPE layers (``attn_temperature_tuning``): each query times
    # log1p(floor((p + 1) / attn_floor_scale)) x attn_temp_scale + 1 at its absolute position p. 0: off.
    attn_floor_scale: float = 0.0
    attn_temp_scale: float = 0.0

    @property
    def local_span(self) -> int:
        """The keys a local layer's query can reach back over: its ``sliding_window``, or its chunk
        (``attn_chunk``: a chunked layer's query sees at most its chunk's first position): the slots of
        the local layers' rolling KV cache (``kv_kinds``). 0: no local rule."""
        return self.sliding_window or self.attn_chunk


def check_variant_fields(cfg) -> None:
    """The variant fields agree with the rest of the config (``cfg`` a ``ModelConfig``)."""
    if cfg.attn_chunk and (not cfg.arch.attention or cfg.sliding_window):
        raise ConfigError("attn_chunk needs a family with attention and no sliding_window (one local rule)")
    if cfg.attn_sinks and not cfg.arch.attention:
        raise ConfigError("attn_sinks=true needs a family with attention; set attn_sinks=false")
    if (
        bool(cfg.attn_floor_scale) != bool(cfg.attn_temp_scale)
        or cfg.attn_floor_scale
        and not cfg.global_nope
    ):
        raise ConfigError("attn_floor_scale and attn_temp_scale go together, on NoPE layers (global_nope)")
    if cfg.qk_l2_norm and (not cfg.arch.attention or cfg.arch.qk_norm):
        raise ConfigError("qk_l2_norm=true needs a family with attention and no q/k norm of its own")
    if cfg.global_nope and not (cfg.arch.attention and cfg.global_every):
        raise ConfigError(
            "global_nope=true needs global layers: set global_every (every N-th layer NoPE), or false"
        )
