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
    # The global layers' own attention shape (transformers' ``global_head_dim`` and, with keys as values,
    # ``num_global_key_value_heads``): their head width and KV heads; 0: the local layers' (head_dim,
    # n_kv_heads). Where either differs the global layers' parameters stack apart ("global_layers",
    # ``layer_kinds``) and their rotary is of their own head width.
    global_head_dim: int = 0
    global_kv_heads: int = 0

    @property
    def global_shape(self) -> bool:
        """Whether the global layers' attention is of another shape than the local layers'."""
        head, kv = self.global_head_dim, self.global_kv_heads
        return bool(head and head != self.dim_per_head or kv and kv != self.kv_heads)

    def global_view(self):
        """The config a global layer's attention computes with: its head width and KV heads in
        ``head_dim`` and ``n_kv_heads`` (the rotary frequencies follow the width)."""
        if not self.global_shape:
            return self
        head, kv = self.global_head_dim or self.dim_per_head, self.global_kv_heads or self.kv_heads
        return self.replace(head_dim=head, n_kv_heads=kv, global_head_dim=0, global_kv_heads=0)

    def attention_kinds(self) -> list[tuple[tuple[int, ...], int, int]]:
        """(layer indices, KV heads, head width) of each attention shape: one entry, or with
        ``global_shape`` the local layers' and the global layers'."""
        every, n = self.global_every, self.n_layers
        if not self.global_shape:
            return [(tuple(range(n)), self.kv_heads, self.dim_per_head)]
        local = tuple(i for i in range(n) if (i + 1) % every)
        view = self.global_view()
        full = tuple(i for i in range(n) if (i + 1) % every == 0)
        return [(local, self.kv_heads, self.dim_per_head), (full, view.kv_heads, view.dim_per_head)]

    @property
    def first_shared(self) -> int:
        """The first layer that reads another layer's keys and values (n_layers: none does)."""
        return self.n_layers - self.kv_shared_layers

    @property
    def per_layer(self) -> bool:
        """Whether the model runs ``model.per_layer``'s stack (per-layer inputs or shared KV)."""
        return bool(self.ple_dim or self.kv_shared_layers or self.layer_scalar or self.value_norm)


UNREAD = ("attn/wk", "attn/wv", "attn/k_norm/scale")  # what a shared layer never reads (k = v: wv)


def read_size(cfg, path: str, size: int) -> int:
    """``size`` elements of parameter ``path`` less the layers that never read theirs (counted as
    transformers has them: not at all): a shared layer's ``wk``, ``wv`` and k norm, a keys-as-values
    global layer's ``wv`` (each stack keeps its layers uniform: ``model.per_layer``)."""
    from meshlm.model.layer_kinds import stacks

    stack, _, rest = path.partition("/")
    layers = stacks(cfg).get(stack) if cfg.per_layer or cfg.k_eq_v else None
    if not layers or rest not in UNREAD:
        return size
    kv_only = lambda i: rest == "attn/wv" and cfg.k_eq_v and (i + 1) % cfg.global_every == 0
    unread = sum(1 for i in layers if i >= cfg.first_shared or kv_only(i))
    return size - size // len(layers) * unread


PER_LAYER_RANGES = {
    **dict.fromkeys(("ple_dim", "ple_vocab", "kv_shared_layers"), Range(int, 0, note="0: none")),
    "rope_global_fraction": Range(float, 0, 1, note="0: every pair rotates"),
    "global_head_dim": Range(int, 0, note="0: head_dim"),
    "global_kv_heads": Range(int, 0, note="0: n_kv_heads"),
}


def check_per_layer(cfg) -> None:
    """The fields agree with the rest of the config (``cfg`` a ``ModelConfig``)."""
    if not cfg.per_layer and not cfg.k_eq_v and not cfg.rope_global_fraction and not cfg.global_shape:
        return
    own_experts = cfg.arch.block == "per_layer"  # Gemma 4's MoE block (``model.per_layer.block``)
    if not cfg.arch.attention or (cfg.arch.moe and not own_experts) or cfg.mla or cfg.full_attn_every:
        raise ConfigError(
            "ple_dim, kv_shared_layers, k_eq_v, value_norm and layer_scalar need an attention family "
            "without latents or linear layers, its experts Gemma 4's; unset them"
        )
    if cfg.arch.moe and cfg.dense_layers:
        raise ConfigError("Gemma 4's experts are in every layer (beside the MLP): set dense_layers to []")
    if cfg.kv_shared_layers and not cfg.global_every:
        raise ConfigError("kv_shared_layers needs layer kinds (global_every): each reads its kind's KV")
    if cfg.kv_shared_layers >= cfg.n_layers:
        raise ConfigError(f"kv_shared_layers={cfg.kv_shared_layers} must be below n_layers={cfg.n_layers}")
    kinds = [(i + 1) % cfg.global_every == 0 for i in range(cfg.n_layers)] if cfg.global_every else []
    if cfg.kv_shared_layers and set(kinds[cfg.first_shared :]) - set(kinds[: cfg.first_shared]):
        raise ConfigError("kv_shared_layers: a shared layer's kind has no earlier layer to read; share fewer")
    if (cfg.k_eq_v or cfg.rope_global_fraction) and not cfg.global_every:
        raise ConfigError("k_eq_v and rope_global_fraction apply to global layers: set global_every")
    if cfg.global_shape:
        _check_global_shape(cfg)


def _check_global_shape(cfg) -> None:
    """Global layers of their own shape: beside local layers with a window (the two caches apart)."""
    if not (cfg.per_layer and cfg.sliding_window and 2 <= cfg.global_every <= cfg.n_layers):
        raise ConfigError(
            "global_head_dim and global_kv_heads need Gemma 4's stack (per-layer fields), a sliding_window "
            "and both kinds of layer (2 <= global_every <= n_layers); set them to 0"
        )
    if cfg.n_heads % (cfg.global_kv_heads or cfg.kv_heads):
        raise ConfigError(f"n_heads={cfg.n_heads} is not a multiple of global_kv_heads={cfg.global_kv_heads}")
