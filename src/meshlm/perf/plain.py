"""A hand-written plain-JAX reference of meshlm's models: the ``plain`` row of ``meshlm bench``.

The same architecture, parameters (meshlm's own parameter tree, layers stacked [L, ...]) and AdamW
step (``optim.make_step``) as meshlm, written the way one writes a small transformer by hand: no
Haiku, no ``shard_map``, no ``Parallel`` context, a Python loop over the layers (fully unrolled),
rotary tables and the causal mask built once per step, attention as [B, H, T, T] scores, and a plain
``log_softmax`` cross-entropy. It is what meshlm's step is measured against: the gap between the two
is the cost of meshlm's generality (one model code for every mesh), which should be close to none.

Every family is covered (``ff``, ``gptj``, ``llama``, ``mistral``'s window, ``gemma``, Gemma 2/3's
local and global layers, grouped-query attention, tied embeddings, z-loss, YaRN's attention factor on
the kinds it scales); its loss equals meshlm's
unsharded loss up to float rounding (tests/test_plain.py).
Shapes are global (one device): tokens [B, T], hidden x [B, T, D].
"""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
import numpy as np

from meshlm.model.attention import kind_tables, layer_kinds
from meshlm.model.attention_variants import Variant, capped_logits, rotary_scale
from meshlm.model.config import ModelConfig
from meshlm.sharding.spmd import with_compute_dtype
from meshlm.train.optim import OptimConfig, adamw, make_step

GELU = lambda x: jax.nn.gelu(x, approximate=True)


def _rms_norm(x, scale, eps):  # [B, T, D]
    x32 = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), -1, keepdims=True) + eps)
    return (scale * y.astype(x.dtype)).astype(x.dtype)


def _layer_norm(x, scale, offset, eps):  # [B, T, D]
    x32 = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    mean = jnp.mean(x32, -1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), -1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + eps) * scale + offset).astype(x.dtype)


def _rotary_tables(cfg: ModelConfig, t: int, dtype, inv_freq=None, scale: float = 1.0):
    """cos, sin [T, rot_dim/2] for positions 0..T-1, once per step (not once per layer), times
    ``scale`` (YaRN's attention factor: 1 otherwise)."""
    inv_freq = cfg.inv_freq() if inv_freq is None else inv_freq
    ang = np.arange(t, dtype=np.float64)[:, None] * inv_freq  # host constants
    dt = jnp.promote_types(dtype, jnp.float32)
    return jnp.asarray(np.cos(ang), dt) * scale, jnp.asarray(np.sin(ang), dt) * scale


def _rotate(cfg: ModelConfig, x, cos, sin):  # x [B, T, h, E]; cos/sin [T, r/2]
    r = cfg.rot_dim
    rot, rest = x[..., :r], x[..., r:]
    c, s = cos[:, None, :].astype(x.dtype), sin[:, None, :].astype(x.dtype)
    if cfg.rotary_kind == "interleaved":
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = jnp.stack([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).reshape(rot.shape)
    else:
        x1, x2 = rot[..., : r // 2], rot[..., r // 2 :]
        out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return jnp.concatenate([out, rest], axis=-1) if rest.shape[-1] else out


def _attention(cfg: ModelConfig, p, x, cos, sin, mask):
    """Causal multi-head attention of x [B, T, D]; K/V heads repeated for grouped queries."""

    def proj(n):  # [B, T, heads, E], plus Qwen2's bias [heads, E] where the family has one
        y = jnp.einsum("btd,dhe->bthe", x, p[f"w{n}"])
        return y + p[f"b{n}"] if f"b{n}" in p else y

    def normed(n, y):  # the q/k norm (``Family.qk_norm``) before rotary: per head, or whole projection
        if f"{n}_norm" not in p:
            return y
        w = p[f"{n}_norm"]
        if w.ndim == 1:  # Qwen3, Gemma 3: [E], the family's RMSNorm
            return _norm(cfg, {"scale": w}, y)
        b, t, h, e = y.shape  # OLMo 2: [heads, E], over heads * E
        return _rms_norm(y.reshape(b, t, h * e), w.reshape(-1), cfg.norm_eps).reshape(y.shape)

    q, k = (_rotate(cfg, normed(n, proj(n)), cos, sin) for n in ("q", "k"))
    v = proj("v")
    groups = cfg.n_heads // cfg.kv_heads
    if groups > 1:
        k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    scores = jnp.einsum("bqhe,bkhe->bhqk", q, k).astype(jnp.promote_types(q.dtype, jnp.float32))
    scores = scores / np.sqrt(cfg.attn_scalar or cfg.dim_per_head)
    variant = Variant.of(cfg, cfg.n_heads, learned=p)  # its learned leaves from this layer's ``p``
    capped = jnp.where(mask, variant.score(scores), jnp.finfo(scores.dtype).min)  # score rule, mask
    probs = jax.nn.softmax(capped, axis=-1)  # [B, H, T, T]; the variant's normaliser (as [B, H, 1, ...])
    probs = variant.finish_probs(probs[:, :, None], scores[:, :, None], mask)[:, :, 0].astype(v.dtype)
    out = jnp.einsum("bhqk,bkhe->bqhe", probs, v)
    out = jnp.einsum("bqhe,hed->bqd", out, p["wo"])
    return out + p["bo"] if "bo" in p else out  # gpt-oss's output bias


def _mlp(p, x, kind: str):
    if kind in ("swiglu", "geglu"):
        act = jax.nn.silu if kind == "swiglu" else GELU
        return (act(x @ p["w_gate"]) * (x @ p["w_up"])) @ p["w_down"]
    return GELU(x @ p["w_in"] + p["b_in"]) @ p["w_out"] + p["b_out"]


def _norm(cfg: ModelConfig, p, x):
    """The family's norm (``Family.norm``) with parameters ``p``."""
    if cfg.arch.norm == "layer":
        return _layer_norm(x, p["scale"], p["offset"], cfg.norm_eps)
    if cfg.arch.norm == "rms_product_first":  # OLMo 2: times w in float32, then cast
        x32 = x.astype(jnp.promote_types(x.dtype, jnp.float32))
        y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), -1, keepdims=True) + cfg.norm_eps)
        return (p["scale"].astype(y.dtype) * y).astype(x.dtype)
    if cfg.arch.norm == "rms_plus_one":  # Gemma: times (1 + w) in float32, then cast
        x32 = x.astype(jnp.promote_types(x.dtype, jnp.float32))
        y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), -1, keepdims=True) + cfg.norm_eps)
        return (y * (1.0 + p["scale"].astype(y.dtype))).astype(x.dtype)
    return _rms_norm(x, p["scale"], cfg.norm_eps)


def _block(cfg: ModelConfig, lp, x, cos, sin, mask):
    """One layer (``Family.block``); lp: this layer's parameters {"attn", "mlp", "ln", "ln2"}."""
    block, mlp = cfg.arch.block, cfg.arch.mlp
    if block == "ff":
        return x + _mlp(lp["mlp"], x, mlp)
    if block == "post_norm":  # OLMo 2: each branch's output normalized, its input not
        x = x + _norm(cfg, lp["post_attn_ln"], _qk_normed_attention(cfg, lp, x, cos, sin, mask))
        return x + _norm(cfg, lp["post_mlp_ln"], _mlp(lp["mlp"], x, mlp))
    h = _norm(cfg, lp["ln"], x)
    if block == "sandwich":  # Gemma 2/3: each branch normalized before and after
        x = x + _norm(cfg, lp["post_attn_ln"], _qk_normed_attention(cfg, lp, h, cos, sin, mask))
        return x + _norm(cfg, lp["post_mlp_ln"], _mlp(lp["mlp"], _norm(cfg, lp["ln2"], x), mlp))
    if block == "parallel":  # attention and MLP in parallel off one norm
        return x + _attention(cfg, lp["attn"], h, cos, sin, mask) + _mlp(lp["mlp"], h, mlp)
    x = x + _qk_normed_attention(cfg, lp, h, cos, sin, mask)
    return x + _mlp(lp["mlp"], _norm(cfg, lp["ln2"], x), mlp)


def _qk_normed_attention(cfg: ModelConfig, lp, h, cos, sin, mask):
    """Attention of h with the layer's q/k norm weights (Qwen3's, OLMo 2's), where the family has them."""
    norms = {n: lp.get(f"attn/{n}_norm") for n in "qk"}
    weights = {f"{n}_norm": next(iter(p.values())) for n, p in norms.items() if p is not None}
    return _attention(cfg, {**lp["attn"], **weights}, h, cos, sin, mask)


def logits(cfg: ModelConfig, params, tokens):
    """tokens [B, T] -> logits [B, T, V] from meshlm's parameter tree (V the real vocabulary: the
    padded rows' columns are dropped, so they take no part in the softmax, as meshlm masks them)."""
    t = tokens.shape[-1]
    table = params["embed"]["embeddings"]  # [V, D]
    x = table[tokens]
    if "b" in params["embed"]:
        x = x + params["embed"]["b"]
    if cfg.arch.embed_scale:  # Gemma
        x = x * jnp.asarray(np.float32(np.sqrt(cfg.d_model)), x.dtype)
    kinds = _kinds(cfg, t, x.dtype)
    layers = {m.removeprefix("layers/"): p for m, p in params.items() if m.startswith("layers/")}
    for i in range(cfg.n_layers):
        kind = kinds[0 if layer_kinds(cfg) is None else layer_kinds(cfg)[i]]
        x = _block(cfg, jax.tree.map(operator.itemgetter(i), layers), x, *kind)
    if cfg.arch.norm is not None:
        x = _norm(cfg, params["final_ln"], x)
    if cfg.tie_embeddings:
        out = x @ table.T
    else:
        out = x @ params["head"]["w"]
        out = out + params["head"]["b"] if "b" in params["head"] else out
    out = capped_logits(cfg, out)
    return out[..., : cfg.vocab_size]


def _kinds(cfg: ModelConfig, t: int, dtype) -> list[tuple]:
    """(cos, sin, mask [T, T]) by layer kind (``attention.kind_tables``: 0 local, 1 global; without
    kinds one, every layer's), built once per step."""
    windows, freqs = kind_tables(cfg) if cfg.global_every else ([cfg.sliding_window], [cfg.inv_freq()])
    scales = [float(rotary_scale(cfg, kind)) for kind in (0, 1)] if cfg.global_every else [rotary_scale(cfg)]
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    out = []
    for window, inv_freq, scale in zip(windows, freqs, scales, strict=True):
        cos, sin = _rotary_tables(cfg, t, dtype, inv_freq, scale) if cfg.arch.attention else (None, None)
        within = (j > i - window) if window else True  # i - window < j
        out.append((cos, sin, jnp.asarray((j <= i) & within)))  # query >= key (within the window)
    return out


def loss(cfg: ModelConfig, params, batch):
    """Mean next-token cross-entropy (+ z-loss) over batch {"inputs", "targets": [B, T]}."""
    z = logits(cfg, params, batch["inputs"])
    z = z.astype(jnp.promote_types(z.dtype, jnp.float32))
    log_z = jax.nn.logsumexp(z, axis=-1)  # [B, T]
    picked = jnp.take_along_axis(z, batch["targets"][..., None], axis=-1)[..., 0]
    per_token = log_z - picked
    if cfg.z_loss:
        per_token = per_token + cfg.z_loss * jnp.square(log_z)
    return jnp.mean(per_token)


def plain_step(cfg: ModelConfig, ocfg: OptimConfig, params, compute_dtype=None):
    """(jitted step, optimizer): the same AdamW step as meshlm's, on the hand-written model.
    ``compute_dtype`` (e.g. bf16): the forward and backward on parameters cast to it, gradients and
    AdamW in the float32 master weights -- the cast ``train --bf16`` applies (``with_compute_dtype``)."""
    opt = adamw(ocfg, params)
    grad = jax.value_and_grad(with_compute_dtype(lambda p, b: loss(cfg, p, b), compute_dtype))
    return jax.jit(make_step(grad, opt, ocfg), donate_argnums=(0, 1)), opt
