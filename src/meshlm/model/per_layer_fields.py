"""``ModelConfig``'s per-layer-input and cross-layer KV fields (Gemma 4's text model; a base, as
``MoEFields``), read by ``model.per_layer``. Absent from a saved config: off, the model as it was.

This module must not import JAX: configs are validated before devices exist.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshlm.errors import ConfigError
from meshlm.ranges import Range


@dataclass(frozen=True)
class PerLayerFields:
    """Per-layer input embeddings, keys reused as values, KV shared across layers (``model.per_layer``)."""

    # Per-layer inputs (transformers' ``hidden_size_per_layer_input``): a second embedding table [ple_vocab,
    # n_layers * ple_dim] and a projection of the embeddings give each layer a [ple_dim] input, which a
    # gate and a projection add to its output. 0: none. ``ple_vocab`` (``vocab_size_per_layer_input``) 0:
    # vocab_size.
    ple_dim: int = 0
    ple_vocab: int = 0
    # The last ``kv_shared_layers`` layers compute no keys or values: each attends with those of the last
    # earlier layer of its kind (local or global; transformers' ``num_kv_shared_layers``). 0: none.
    kv_shared_layers: int = 0
    # The global layers' values are their keys' projection (``attention_k_eq_v``): before the k norm and
    # rotary, through the value norm. False: their own.
    k_eq_v: bool = False
    # Values RMS-normed without a weight (Gemma 4's ``v_norm``), the layer's output times a fixed per-layer
    # ``layer_scalar`` [1] (a parameter, read from and written to transformers' buffer).
    value_norm: bool = False
    layer_scalar: bool = False
    # The global layers rotate only this fraction of each head's pairs, the rest get frequency 0
    # (transformers' "proportional" RoPE, ``partial_rotary_factor``). 0: every pair (as before).
    rope_global_fraction: float = 0.0

    @property
    def first_shared(self) -> int:
        """The first layer that reads another layer's keys and values (n_layers: none does)."""
        return self.n_layers - self.kv_shared_layers

    @property
    def per_layer(self) -> bool:
        """Whether the model runs ``model.per_layer``'s stack (per-layer inputs or shared KV)."""
        return bool(self.ple_dim or self.kv_shared_layers or self.layer_scalar or self.value_norm)


def read_size(cfg, path: str, size: int) -> int:
    """``size`` elements of parameter ``path`` less the layers that never read theirs (counted as
    transformers has them: not at all): a shared layer's ``wk``, ``wv`` and k norm, a keys-as-values
    global layer's ``wv`` (the stack keeps them uniform: ``model.per_layer``)."""
    shared = cfg.n_layers - cfg.first_shared
    unread = {"layers/attn/wk": shared, "layers/attn/k_norm/scale": shared, "layers/attn/wv": shared}
    if cfg.k_eq_v and cfg.global_every:
        unread["layers/attn/wv"] += cfg.first_shared // cfg.global_every  # the global layers among them
    return size - size // cfg.n_layers * unread.get(path, 0) if cfg.per_layer or cfg.k_eq_v else size


PER_LAYER_RANGES = {
    **dict.fromkeys(("ple_dim", "ple_vocab", "kv_shared_layers"), Range(int, 0, note="0: none")),
    "rope_global_fraction": Range(float, 0, 1, note="0: every pair rotates"),
}


def check_per_layer(cfg) -> None:
    """The fields agree with the rest of the config (``cfg`` a ``ModelConfig``)."""
    if not cfg.per_layer and not cfg.k_eq_v and not cfg.rope_global_fraction:
        return
    if not cfg.arch.attention or cfg.arch.moe or cfg.mla or cfg.full_attn_every:
        raise ConfigError(
            "ple_dim, kv_shared_layers, k_eq_v, value_norm and layer_scalar need a dense attention family "
            "without experts, latents or linear layers; unset them"
        )
    if cfg.kv_shared_layers and not cfg.global_every:
        raise ConfigError("kv_shared_layers needs layer kinds (global_every): each reads its kind's KV")
    if cfg.kv_shared_layers >= cfg.n_layers:
        raise ConfigError(f"kv_shared_layers={cfg.kv_shared_layers} must be below n_layers={cfg.n_layers}")
    kinds = [(i + 1) % cfg.global_every == 0 for i in range(cfg.n_layers)] if cfg.global_every else []
    if cfg.kv_shared_layers and set(kinds[cfg.first_shared :]) - set(kinds[: cfg.first_shared]):
        raise ConfigError("kv_shared_layers: a shared layer's kind has no earlier layer to read; share fewer")
    if (cfg.k_eq_v or cfg.rope_global_fraction) and not cfg.global_every:
        raise ConfigError("k_eq_v and rope_global_fraction apply to global layers: set global_every")
