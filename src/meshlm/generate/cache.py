"""The KV cache of generation: its layout on the mesh, its size, and an empty one.

KV cache ``{"k", "v"}``: global [L, B, S, Kc * E], spec ``P(None, DP, None, MP)``, per shard
[L, B/dp, S, Kc/mp * E]: each token's KV heads side by side in one flat minor dimension (head-major, so
mp's split of it is its split of the heads). Flat because a TPU tiles an array's two minor dimensions
by (8, 128) (bf16: (16, 128)): [.., Kc, E] with llama-100m's Kc = 12, E = 64 padded to 16 x 128, 2.67x
the bytes every decode step reads, and XLA:TPU relaid the whole cache out at every decode program's
entry and exit; [.., S, Kc * E] (576 x 768) is dense, written in place by one scatter a layer
(``attention._put``; a decode step's on a TPU by a Pallas kernel, ``model.cache_kernel``) and read as it
lies (``attention._flat_scores``). ``Kc = n_kv_heads`` when mp
divides them, so each device holds total/(dp*mp)
bytes. When KV heads are replicated (mp > n_kv_heads, see ``attention.kv_replicated``) ``Kc = mp``:
each shard stores only the one KV head its query heads use (per shard Kc/mp = 1). Prefill writes all
S slots, padding included; a padding slot is either overwritten by ``decode_step`` before any query
can see it (a step writes slot p, then attends to slots <= p) or stays masked.

Rolling cache (``attention.cache_window``: every layer has a sliding window W, as Mistral): when S > W
the decode cache has W slots, position p in slot p % W (``attention.cache_update``), so its memory is
the window's, not the context's. The prefill still runs the whole padded prompt at once (its cache, S
slots, lives only inside the prefill program) and keeps each row's last W prompt positions
(``keep_window``): exactly the keys a later query can see.

Local and global layers (Gemma 2/3, gpt-oss, OLMo 3; Llama 4's chunked layers, ``model.kv_kinds``): the
global layers' cache "k", "v" [L_global, B, S, Kc * E] and the local layers' "k_local", "v_local" [L_local,
B, W, Kc * E] (W = min(window or chunk, S): ``local_span``), both laid out as above: each local layer holds
its window or chunk (rolling: a chunked layer's W slots hold its current chunk's keys, and the mask hides
the previous chunk's still held), each global one the context. The prefill holds S slots in both and
keeps each row's last W prompt positions in the local ones.

Multi-head latent attention (``model.mla``: ``cfg.mla``) caches what its keys and values are made of,
not them: "k" the normed latent [L, B, S, Kc * r] (kv_lora_rank) and "v" the rotated rotary key [L, B,
S, Kc * R] (qk_rope_head_dim), r + R values per token and layer (DeepSeek-V3: 512 + 64 = 576, against
full K/V's 128 heads x (192 + 128) = 40960: ``values_per_token``' "ratio", 71.11). Each decode step
applies the up-projection ``wkv_b`` to the cached latents (exact; not absorbed into q and ``wo``: the
same values, one more matmul per step over the context). The latent is per token, the same for every
head: it is replicated over mp, Kc = mp with one copy per shard (as replicated KV heads are), so every
device holds r + R values per token and layer of its rows.

Linear-attention layers (a hybrid's Gated DeltaNet, ``model.linear_cache``): the full-attention layers'
"k", "v" [L_full, B, S, Kc * E] as above, and per linear layer its recurrent state "state" [L_lin, B, Vh,
dk, dv] (at least float32; value heads over mp), the conv's history "conv" [L_lin, B, K-1, C] (C = the
q, k, v channels, over mp: each shard's own side by side) and each row's token count "length" [L_lin,
B] (int32, set by ``programs`` before each call): constant in the context length.

The "ff" family has no attention and no positions, so it needs no cache (an empty dict): see
``programs`` for why running it on the last token alone is exact.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from meshlm.model.attention import cache_window, kv_replicated
from meshlm.model.config import ModelConfig
from meshlm.model.kv_kinds import LOCAL_KEYS, kind_counts, mixed_kinds
from meshlm.parallel.context import Parallel
from meshlm.parallel.layout import Layout

CACHE_DIMS = (None, "batch", None, "kv_heads")  # global [L, B, S, Kc * E]: ``Layout.spec``'s names
LINEAR_DIMS = {  # the linear layers' arrays (``model.linear_cache``)
    "state": (None, "batch", "heads", None, None),
    "conv": (None, "batch", None, "heads"),
    "length": (None, "batch"),
}


def cache_specs(cfg: ModelConfig, layout: Layout) -> dict:
    """The K and V caches' specs on ``layout``: rows over its data shards (DP, or (DP, EP) with ep on),
    KV heads over mp (P(None, DP, None, MP) on a dp x mp mesh: the flat Kc * E split by heads)."""
    return {name: layout.spec(*LINEAR_DIMS.get(name, CACHE_DIMS)) for name in cache_shapes(cfg, 1, 1, 1)}


def cache_heads(cfg: ModelConfig, mp: int) -> tuple[int, int]:
    """(global Kc, per-shard Kc/mp) of the cache's KV-head dimension."""
    if cfg.mla or kv_replicated(cfg.kv_heads, mp):  # MLA: the latent, one copy per mp shard
        return mp, 1  # one stored KV head per shard: the one its queries use
    return cfg.kv_heads, cfg.kv_heads // mp


def cache_len(cfg: ModelConfig, max_len: int) -> int:
    """Slots per layer of the decode cache: the window when it rolls (``cache_window``), else max_len."""
    window = cache_window(cfg)
    return min(window, max_len) if window else max_len


def cache_shapes(cfg: ModelConfig, mp: int, batch: int, max_len: int, slots=None) -> dict:
    """Global shape [L, B, S, Kc * E] of each decode cache array for a global ``batch`` (S =
    ``cache_len``: the window for a rolling cache), by name: "k", "v", and with local and global layers
    (``mixed_kinds``) the local ones' "k_local", "v_local" of min(window, max_len) slots. ``slots``:
    every array's S instead (the prefill's), and ``mp``'s Kc replaced by Kc/mp (per shard). Flat: see
    this module's docstring."""
    if not cfg.arch.attention:
        return {}
    heads = cache_heads(cfg, mp)[0 if slots is None else 1]
    if not mixed_kinds(cfg):
        s = cache_len(cfg, max_len) if slots is None else slots
        widths = latent_widths(cfg) or (cfg.dim_per_head,) * 2
        n_linear = len(cfg.linear_layers) if cfg.full_attn_every else 0
        kv = {n: (cfg.n_layers - n_linear, batch, s, heads * w) for n, w in zip("kv", widths, strict=True)}
        return kv | (_linear_shapes(cfg, n_linear, 1 if slots is None else mp, batch) if n_linear else {})
    (n_local, n_global), local = kind_counts(cfg), min(cfg.local_span, max_len)
    full = cfg.global_view()  # the global layers' heads and width (Gemma 4's may be their own)
    full_heads = cache_heads(full, mp)[0 if slots is None else 1]
    shapes = {n: (n_global, batch, slots or max_len, full_heads * full.dim_per_head) for n in "kv"}
    return shapes | {n: (n_local, batch, slots or local, heads * cfg.dim_per_head) for n in LOCAL_KEYS}


def latent_widths(cfg: ModelConfig) -> tuple[int, int] | None:
    """MLA's cache widths: ("k" the latent's r, "v" the rotary key's R); None for K/V caches."""
    return (cfg.kv_lora_rank, cfg.rot_dim) if cfg.mla else None


def values_per_token(cfg: ModelConfig) -> dict:
    """The cache's values per token and layer, one copy ("values": K/V's 2 x K x E, MLA's r + R) and,
    for MLA, full K/V's ("full_kv": H x (E + Ev), v unpadded) and their ratio full_kv / values
    (DeepSeek-V3: 576 against 128 x (192 + 128) = 40960, 71.11)."""
    if not cfg.mla:
        return {"values": 2 * cfg.kv_heads * cfg.dim_per_head}
    values, full = sum(latent_widths(cfg)), cfg.n_heads * (cfg.head_dim + cfg.v_head_dim)
    return {"values": values, "full_kv": full, "ratio": round(full / values, 2)}


def _linear_shapes(cfg: ModelConfig, layers: int, mp: int, batch: int) -> dict:
    """The linear layers' arrays (global shapes; per shard with ``mp``'s head split)."""
    vh, dk, dv = cfg.linear_value_heads // mp, cfg.linear_key_dim, cfg.linear_value_dim
    channels = (2 * cfg.linear_key_heads * dk + cfg.linear_value_heads * dv) // mp
    state = (layers, batch, vh, dk, dv)
    return {"state": state, "conv": (layers, batch, cfg.linear_conv - 1, channels), "length": (layers, batch)}


def cache_dtypes(cfg: ModelConfig, dtype) -> dict:
    """Each cache array's dtype: ``dtype`` (the parameters'), the recurrent state in at least float32
    and the row lengths int32."""
    out = dict.fromkeys(cache_shapes(cfg, 1, 1, 1), jnp.dtype(dtype))
    linear = {"state": jnp.promote_types(dtype, jnp.float32), "length": jnp.dtype(jnp.int32)}
    return out | {k: v for k, v in linear.items() if k in out}


def cache_bytes(cfg: ModelConfig, where, batch: int, max_len: int, dtype=jnp.float32) -> dict:
    """{"total", "per_device"} bytes of the K and V decode caches for a global ``batch`` on ``where`` (a
    Layout or a jax Mesh), "slots": positions held per layer (the window for a rolling cache; with
    local and global layers the global ones', and "local_slots" the local ones': their window),
    "per_token_layer": the values cached per token and layer (``values_per_token``), and with
    linear-attention layers "linear_state": their arrays' bytes (in "total"; constant in ``max_len``)."""
    if not cfg.arch.attention:
        return {"total": 0, "per_device": 0, "slots": 0}
    layout = Layout.of(where)
    shapes, dtypes = cache_shapes(cfg, layout.mp, batch, max_len), cache_dtypes(cfg, dtype)
    size = {n: math.prod(shape) * dtypes[n].itemsize for n, shape in shapes.items()}
    total = sum(size.values())
    out = {"total": total, "per_device": total // layout.devices, "slots": shapes["k"][2]}
    out |= {"per_token_layer": values_per_token(cfg)}
    if "state" in shapes:  # the linear layers': the same at any context length
        out["linear_state"] = sum(size[n] for n in LINEAR_DIMS)
    return out | ({"local_slots": shapes["k_local"][2]} if "k_local" in shapes else {})


def keep_window(cfg: ModelConfig, cache: dict, lengths) -> dict:
    """A prefill's per-shard cache [L, B/dp, S, Kc/mp * E] -> the rolling one [L, B/dp, W, ...] when
    S > W: slot s gets each row's newest prompt position congruent to s, (n - 1) - ((n - 1 - s) mod W)
    for a row of ``lengths`` [B/dp] = n (one below 0: a slot no query sees, left as position 0's).
    With local and global layers (``mixed_kinds``) only the local layers' arrays roll."""
    mixed = mixed_kinds(cfg)
    window, s = cfg.local_span if mixed else cache_window(cfg), cache["k"].shape[2] if cache else 0
    if not window or s <= window:
        return cache
    last = lengths[:, None] - 1  # [B, 1]
    held = last - (last - jnp.arange(window)) % window  # [B, W]
    index = jnp.maximum(held, 0)[None, :, :, None]
    rolls = LOCAL_KEYS if mixed else tuple(cache)
    return {n: jnp.take_along_axis(c, index, axis=2) if n in rolls else c for n, c in cache.items()}


def empty_cache(cfg: ModelConfig, par: Parallel, shard_batch: int, max_len: int, dtype) -> dict:
    """Zeros of the per-shard shapes [L, B/dp, S, Kc/mp * E] (the prefill's: S = ``max_len`` slots in
    every array, local layers' included), ``shard_batch`` = B/dp (made on device, inside shard_map)."""
    shapes, dtypes = (
        cache_shapes(cfg, par.layout.mp, shard_batch, max_len, slots=max_len),
        cache_dtypes(cfg, dtype),
    )
    return {name: jnp.zeros(shape, dtypes[name]) for name, shape in shapes.items()}
