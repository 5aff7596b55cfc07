"""A linear-attention layer (Gated DeltaNet: Qwen3.5's ``linear_attention`` layers), sharded by heads.

Per shard (``/mp`` = per-shard size; Kh key heads of dk, Vh value heads of dv, Vh a multiple of Kh;
transformers' ``Qwen3_5GatedDeltaNet``):
  wq, wk [D, Kh/mp, dk]   wv, wz [D, Vh/mp, dv]   wa, wb [D, Vh/mp]        (column-parallel)
  conv_q, conv_k [K, Kh/mp, dk]   conv_v [K, Vh/mp, dv]   (depthwise: each channel its own K taps)
  a_log, dt_bias [Vh/mp]   norm/scale [dv] replicated   wo [Vh/mp, dv, D] (row-parallel)

Key head j serves value heads j*r ... j*r + r - 1 (r = Vh/Kh, transformers' ``repeat_interleave``), so
splitting both head axes into mp contiguous slices keeps each key head on the shard of its value heads:
no collective inside the layer, one row-parallel sum after ``wo`` (as attention). The recurrence
runs over the whole sequence of each row (``par.f`` gathers it under sp); with ``--doc-mask`` the conv
and the state restart at each document (``model.deltanet``); under cp each shard's chunks start from
the conv tails and the states of the chunks before them (``model.linear_context``).
"""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

import meshlm.model.deltanet as deltanet
import meshlm.model.linear_cache as linear_cache
import meshlm.model.linear_context as linear_context
from meshlm.model.config import ModelConfig
from meshlm.model.dense import dense, dense_heads_in, dense_heads_out
from meshlm.model.layers import RMSNorm, _normal
from meshlm.parallel.context import Parallel


def _a_log_init(shape, dtype):
    """log A with A spread evenly over [0.05, 1] (transformers draws A from [0.01, 16]). Deterministic and
    mild on purpose: with A up to 16 a head's per-token decay reaches e^-20, its state forgets within a
    token or two (no chunk-crossing state left to prove) and its decay parameters' gradients shrink to
    rounding, which AdamW's normalisation then magnifies past float64's proof tolerance. The init's
    values matter only for training from scratch (a converted model brings its own)."""
    return jnp.log(jnp.linspace(0.05, 1.0, int(np.prod(shape)), dtype=dtype).reshape(shape))


class GatedDeltaNet(hk.Module):
    """Returns the per-shard partial output [B, T, D] (reduce with ``par.row_out``)."""

    def __init__(self, *, cfg: ModelConfig, par: Parallel, stddev: float, name: str = "linear"):
        super().__init__(name=name)
        self.cfg, self.par, self.stddev = cfg, par, stddev

    def _proj(self, name, xf, heads, e):  # xf [B, T, D] -> [B, T, heads, e]
        w = hk.get_parameter(name, [xf.shape[-1], heads, e], init=_normal(self.stddev))
        return dense_heads_in(xf, w)

    def _convs(self, xs, positions, starts, cache):
        """(q, k, v) [B, T, h, e] each -> (silu(causal conv(.)) of each, the conv's new cached history or
        None): one depthwise conv over their channels side by side (as transformers' fused ``conv1d``),
        each channel its own K taps."""
        kernel, flat = self.cfg.linear_conv, [x.reshape(*x.shape[:2], -1) for x in xs]
        ws = [
            hk.get_parameter(f"conv_{n}", [kernel, *x.shape[2:]], init=_normal(1.0 / np.sqrt(kernel)))
            for n, x in zip("qkv", xs, strict=True)
        ]
        x, w = jnp.concatenate(flat, -1), jnp.concatenate([w.reshape(kernel, -1) for w in ws], -1)
        history = None
        if cache is not None and self.par.context_parallel:  # a prefill over cp: history summed over cp
            out = linear_context.cp_conv(x, w, self.par)
            history = linear_context.cp_history(x, positions, cache["length"], kernel, self.par)
        elif cache is not None:  # generation: after the cached inputs (``model.linear_cache``)
            out, history = linear_cache.cached_conv(x, w, positions, starts, cache)
        elif self.par.context_parallel:  # each chunk after the tail of the one before it (another shard's)
            out = linear_context.cp_conv(x, w, self.par)
        else:
            out = deltanet.causal_conv(x, w, positions, starts)
        parts = jnp.split(jax.nn.silu(out), np.cumsum([f.shape[-1] for f in flat[:-1]]), axis=-1)
        return tuple(p.reshape(x.shape) for p, x in zip(parts, xs, strict=True)), history

    def _rule(self, q, k, v, g, beta, positions, starts, cache):  # -> (out [B, T, h, dv], state or None)
        chunk, cp = self.cfg.linear_chunk, self.par.context_parallel
        if cache is not None and cp:  # a prefill over cp (from zeros): the padding kept out of the state
            return linear_context.cp_prefill_rule(
                q, k, v, g, beta, positions, cache["length"], chunk, self.par
            )
        if cache is not None:  # generation: from the cached state (``model.linear_cache``)
            return linear_cache.cached_rule(q, k, v, g, beta, positions, starts, cache, chunk)
        if cp:  # each chunk from the state the chunks before it leave
            return linear_context.cp_rule(q, k, v, g, beta, chunk, self.par)[0], None
        b, _, h, dv = v.shape
        state = jnp.zeros((b, h, k.shape[-1], dv), v.dtype)  # [B, h, dk, dv] per shard
        resets = deltanet.document_resets(positions, starts)
        return deltanet.chunked_rule(q, k, v, g, beta, state, chunk, resets)[0], None

    def __call__(self, xf, positions, starts=None, cache=None):
        """xf [B, T, D] (the whole sequence of each row), positions [B, T] absolute, starts None or
        [B, T] (``--doc-mask``), cache None or this layer's (``model.linear_cache``) -> (partial
        [B, T, D], the new cache or None)."""
        cfg, mp = self.cfg, self.par.layout.mp
        kh, vh = cfg.linear_key_heads // mp, cfg.linear_value_heads // mp
        dk, dv = cfg.linear_key_dim, cfg.linear_value_dim
        q, k = self._proj("wq", xf, kh, dk), self._proj("wk", xf, kh, dk)
        v = self._proj("wv", xf, vh, dv)
        (q, k, v), history = self._convs((q, k, v), positions, starts, cache)
        z = self._proj("wz", xf, vh, dv)
        wa, wb = (hk.get_parameter(n, [xf.shape[-1], vh], init=_normal(self.stddev)) for n in ("wa", "wb"))
        a_log = hk.get_parameter("a_log", [vh], init=_a_log_init)
        dt_bias = hk.get_parameter("dt_bias", [vh], init=jnp.ones)
        dtype = jnp.promote_types(xf.dtype, jnp.float32)  # the rule in at least float32 (as transformers)
        g = -jnp.exp(a_log.astype(dtype)) * jax.nn.softplus(
            dense(xf, wa).astype(dtype) + dt_bias
        )  # [B, T, h]
        beta = deltanet.write_strength(dense(xf, wb).astype(dtype))
        q, k = self.par.tap("linear_key_heads", (deltanet.l2norm(q), deltanet.l2norm(k)))
        q, k = (jnp.repeat(x, vh // kh, axis=2) for x in (q, k))  # key head j -> its r value heads
        out, state = self._rule(q, k, v.astype(dtype), g, beta, positions, starts, cache)
        out = RMSNorm(eps=cfg.norm_eps, name="norm")(out.astype(xf.dtype)) * jax.nn.silu(z)  # gated norm
        wo = hk.get_parameter("wo", [vh, dv, xf.shape[-1]], init=_normal(self.stddev))
        if cache is not None:  # stored in the cache's own dtypes (the state in at least float32)
            cache = {
                **cache,
                "state": state.astype(cache["state"].dtype),
                "conv": history.astype(cache["conv"].dtype),
            }
        return dense_heads_out(out, wo), cache


def linear_mixer(cfg: ModelConfig, par: Parallel, stddev: float):
    """The layer's mixer as an attention module is called (``model.moe.moe_layer``'s ``attention()``):
    (xf, positions, cache, starts, kind) -> (partial [B, T, D], cache); no layer kinds among linear layers
    (``kind`` is None)."""
    net = GatedDeltaNet(cfg=cfg, par=par, stddev=stddev)
    return lambda xf, positions, cache=None, starts=None, kind=None: net(xf, positions, starts, cache)


def linear_layer(cfg: ModelConfig, par: Parallel, norm, mlp, stddev: float):
    """A linear-attention layer of a sequential (pre-norm) block: x + mixer(norm(x)), then x +
    mlp(norm(x)); ``norm(name)`` and ``mlp()`` make the family's norm and MLP. ``cache``: the layer's
    recurrent state and conv history in generation (``model.linear_cache``)."""

    def layer(x, positions, cache=None, starts=None, kind=None):
        xf = par.f(norm("ln")(x))
        partial, cache = GatedDeltaNet(cfg=cfg, par=par, stddev=stddev)(xf, positions, starts, cache)
        x = x + par.row_out(partial)
        out, b = mlp()(par.f(norm("ln2")(x)))
        return x + par.row_out(out, b), cache

    return layer
