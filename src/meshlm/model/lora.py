"""LoRA adapters (Hu et al. 2021): a targeted weight W [in, out] gains A [in, R] and B [R, out], and its
layer computes ``dense(x, W) + (alpha / R) * (x A) B``; the base weights are frozen. With
``--lora-dropout P`` the train step's adapters take ``dropout(x)`` (``model.lora_dropout``).

The delta lives here alone (``delta``), called by the attention's projections and the MLP's matmuls
after their own ``dense``. Per-shard shapes inside ``shard_map``: an adapter is requested with its base
weight's per-shard in/out dims, so the rules table (``sharding.rules``) splits it as its base is split:
a column-parallel base's B over mp (its output heads / hidden units), a row-parallel base's A over mp
(its input heads / hidden units; the delta is then a partial sum, which the base's all-reduce sums).
The rank dimension is never split. Adapters are never FSDP slices (their names are not matmul
weights), so they are replicated over the data shards and their gradients summed there by the one
data-parallel all-reduce of ``sharding.spmd``.

Parameter paths: the adapter of ``<module>/<w>`` is ``<module>/lora_<w>_a`` and ``..._b`` (leaves of
the base's module, e.g. ``layers/attn/lora_wq_a`` [L, D, R]). Which parameter a target name (``q``,
``k``, ``v``, ``o``, ``gate``, ``up``, ``down``) means is its family's fact (``Family.lora_targets``).
Frozen: every
other parameter passes ``lax.stop_gradient`` as it is read (``freeze``), and the train step updates
and keeps AdamW state for the adapters alone (``adapters``). B starts at zero: the adapted model's first
output is bitwise the base's. QLoRA (a quantised base) is not supported.
"""

from __future__ import annotations

import contextlib
import math

import haiku as hk
import jax.numpy as jnp
from jax import lax

from meshlm.model.lora_dropout import dropped
from meshlm.model.lora_fields import ADAPTER, LoraFields, check_lora, without_lora  # noqa: F401 - re-exported
from meshlm.model.params import is_stacked, param_path

_KAIMING = hk.initializers.VarianceScaling(1 / 3, "fan_in", "uniform")


def delta(cfg, par, path: str, x, in_shape, out_shape, kv_index=None):
    """The adapter's term of the weight ``path`` ("attn/wq", ...), or None where ``path`` is no target.

    x: [..., *in_shape] per shard; returns [..., *out_shape] ([..., 1, E] with ``kv_index``).
    ``in_shape`` / ``out_shape``: the base weight's per-shard input and output dims as its layer
    requests them; ``kv_index``: the base's KV heads are replicated (mp > K) and this shard uses head
    ``kv_index`` of the whole [D, K, E] weight: B [R, K, E] is requested whole and sliced as it is."""
    if cfg is None or path not in cfg.lora_paths:
        return None
    r = cfg.lora_rank
    w = path.rsplit("/", 1)[1]
    # A: peft's kaiming_uniform(a=sqrt(5)): bound 1/sqrt(fan_in), fan_in the global input dims
    a = hk.get_parameter(f"{ADAPTER}{w}_a", [*in_shape, r], init=_KAIMING)
    b = hk.get_parameter(f"{ADAPTER}{w}_b", [r, *out_shape], init=jnp.zeros)
    b = par.tap("lora_b", b)  # B as this shard uses it (the proof's data-shard-sum control plants here)
    if kv_index is not None:
        b = lax.dynamic_slice_in_dim(b, kv_index, 1, axis=1)  # [R, 1, E]: this shard's KV head
    x = dropped(cfg, par, path, x, in_shape)  # --lora-dropout, in the train step only
    k = math.prod(in_shape)
    lead = x.shape[: x.ndim - len(in_shape)]
    # plain matmuls, not ``dense``: an adapter replicated over mp meets mp-varying activations (a
    # row-parallel base's B, a column-parallel base's A), and JAX's own transpose sums its gradient
    scale = par.tap("lora_scale", jnp.asarray(cfg.lora_scale, x.dtype))  # alpha / R, once
    xa = (x.reshape(*lead, k) @ a.reshape(k, r)) * scale  # [..., R]
    return (xa @ b.reshape(r, -1)).reshape(*lead, *b.shape[1:])


def adapted(cfg, par, path: str, x, y, in_shape, out_shape=None, kv_index=None):
    """``y`` (the base's dense(x, W) [..., *out] per shard) plus ``delta``'s term of ``path``, if it
    is a target; ``out_shape``: B's requested dims where they are not y's (``kv_index``)."""
    out_shape = y.shape[x.ndim - len(in_shape) :] if out_shape is None else out_shape
    d = delta(cfg, par, path, x, in_shape, out_shape, kv_index)
    return y if d is None else y + d


def is_adapter(path: str) -> bool:
    """Whether a parameter (its path, or its leaf name) is an adapter's."""
    return path.rsplit("/", 1)[-1].startswith(ADAPTER)


def _select(tree: dict, keep: bool) -> dict:
    picked = {m: {n: v for n, v in leaves.items() if is_adapter(n) == keep} for m, leaves in tree.items()}
    return {m: leaves for m, leaves in picked.items() if leaves}


def adapters(tree: dict) -> dict:
    """The adapters' part of a Haiku tree (params, specs, grads): what LoRA trains."""
    return _select(tree, True)


def base(tree: dict) -> dict:
    """The rest: the frozen base model's part."""
    return _select(tree, False)


def combine(base_tree: dict, adapter_tree: dict) -> dict:
    """One Haiku tree of the two parts (``base``, ``adapters``)."""
    out = {m: dict(leaves) for m, leaves in base_tree.items()}
    for m, leaves in adapter_tree.items():
        out.setdefault(m, {}).update(leaves)
    return out


class Adapters:
    """What a LoRA step trains (``train.optim.trainable``): the adapters; the base is kept as it is."""

    select = staticmethod(adapters)

    @staticmethod
    def put(params, trained):
        return combine(base(params), trained)


def freeze(cfg):
    """A context for the model's forward: with LoRA on, every base parameter is read through
    ``lax.stop_gradient`` (no gradient flows to it, so none is computed); else nothing."""
    if not cfg.lora_rank:
        return contextlib.nullcontext()

    def getter(next_getter, value, context):
        return next_getter(value if is_adapter(context.name) else lax.stop_gradient(value))

    return hk.custom_getter(getter)


def merged(cfg, params: dict, scale: float | None = None) -> dict:
    """The base parameters with each adapter merged in: W + (alpha / R) A B (global arrays, a stacked
    weight's leading layer dimension kept); the model without LoRA computes with them what the adapted
    model computes (``meshlm convert --merge``; the proof checks it in float64, at its own account of
    the scale: ``scale``, None for ``cfg.lora_scale``)."""
    scale = cfg.lora_scale if scale is None else scale
    out = base(params)
    for mod, leaves in adapters(params).items():
        for name in [n for n in leaves if n.endswith("_a")]:
            w_name = name[len(ADAPTER) : -2]
            w, a, b = out[mod][w_name], leaves[name], leaves[name[:-2] + "_b"]
            n = 1 if is_stacked(param_path(mod, w_name)) else 0  # [L, ...]: one product per layer
            r = a.shape[-1]
            prod = jnp.matmul(a.reshape(*a.shape[:n], -1, r), b.reshape(*b.shape[:n], r, -1))
            new = w + (prod * jnp.asarray(scale, prod.dtype)).reshape(w.shape)
            # the wider of the two dtypes: a bf16 base (--base-dtype) merged with float32 adapters is
            # float32, as the adapted model computes it
            out[mod] = {**out[mod], w_name: new.astype(jnp.promote_types(w.dtype, a.dtype))}
    return out
