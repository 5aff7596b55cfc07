"""Haiku modules for Megatron-style tensor parallelism.

Shape glossary (``/mp`` marks a per-shard size; everything else is global):
  B  batch rows on this data-parallel shard     T  sequence length      D  d_model
  V  vocabulary size                             F  feed-forward width   H  query heads
  K  key/value heads                             E  head width (head_dim)

Parameters are requested in their *per-shard* shape (``V/mp`` rows of the embedding, ``F/mp``
hidden units, ``H/mp`` heads). Unsharded, ``mp == 1`` and per-shard equals global, so one code path
serves both; Haiku checks every provided parameter against the requested shape.

Activations named ``x`` are replicated over the model axis; ``xf`` is ``par.f(x)`` (per-shard view,
all-reduce in backward); modules ending in a row-parallel matmul return *partial* sums that the
caller reduces with ``par.row_out`` so a block can fuse several into one all-reduce.
"""

from __future__ import annotations

import math

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from meshlm.model.dense import dense
from meshlm.model.lora import adapted
from meshlm.model.quant import matmul
from meshlm.parallel.context import Parallel


def _normal(stddev: float):
    return hk.initializers.TruncatedNormal(stddev=stddev)


def varying_like(tree, *refs):
    """``tree`` typed as varying over every manual mesh axis that one of ``refs`` varies over (inside
    ``shard_map`` a loop carry and both branches of a cond must agree; outside it: unchanged)."""
    varying = lambda x: jax.typeof(x).manual_axis_type.varying
    axes = set().union(*(varying(r) for r in jax.tree.leaves(refs)))

    def cast(x):
        missing = tuple(sorted(axes - varying(x)))
        return lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


def upcast(x):
    """At least float32 (float64 stays float64, so the x64 proof is exact)."""
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


class VocabEmbed(hk.Module):
    """Vocabulary-parallel embedding: each shard owns a contiguous slice of V/mp rows.

    Lookup gathers the rows this shard owns (ids outside the slice give zeros) and sums over shards:
    O(tokens x D) work per shard, never a [tokens, V] one-hot matmul.
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        d_model: int,
        par: Parallel,
        stddev: float,
        bias: bool = False,
        real_vocab: int | None = None,
        name="embed",
    ):
        super().__init__(name=name)
        self.vocab, self.d_model, self.par, self.stddev, self.bias = vocab_size, d_model, par, stddev, bias
        self.real_vocab = real_vocab or vocab_size  # rows from real_vocab on are padding (zero at init)

    def _table(self):  # [V/mp, D]
        init = zero_padding(_normal(self.stddev), self.par, self.real_vocab, axis=0)
        return hk.get_parameter("embeddings", [self.vocab // self.par.layout.mp, self.d_model], init=init)

    def __call__(self, tokens):  # tokens: [B, T] global ids -> [B, T, D] replicated
        table = self._table()
        local = tokens - self.par.vocab_start(table.shape[0])
        inside = (local >= 0) & (local < table.shape[0])
        rows = jnp.take(table, jnp.where(inside, local, 0), axis=0)  # [B, T, D] partial
        rows = jnp.where(inside[..., None], rows, jnp.zeros((), rows.dtype))
        b = hk.get_parameter("b", [self.d_model], init=jnp.zeros) if self.bias else None
        return self.par.row_out(rows, b)

    def local_logits(self, xf):  # tied output projection: [B, T, D] -> [B, T, V/mp] per-shard
        return project(xf, *self.head_weights())

    def head_weights(self):
        """The tied output projection's (w [D, V/mp], no bias) as this shard uses them."""
        return self.par.tap("tied_table", self._table()).T, None


class VocabHead(hk.Module):
    """Vocabulary-parallel output projection: w [D, V/mp], b [V/mp] per shard."""

    def __init__(
        self,
        *,
        vocab_size: int,
        par: Parallel,
        stddev: float,
        bias: bool,
        real_vocab: int | None = None,
        name: str = "head",
    ):
        super().__init__(name=name)
        self.vocab, self.par, self.stddev, self.bias = vocab_size, par, stddev, bias
        self.real_vocab = real_vocab or vocab_size  # columns from real_vocab on are padding

    def local_logits(self, xf):  # [B, T, D] -> [B, T, V/mp] per-shard
        return project(xf, *self.weights(xf.shape[-1]))

    def weights(self, d_model: int):
        """(w [D, V/mp], b [V/mp] or None) per shard."""
        vs = self.vocab // self.par.layout.mp
        init = zero_padding(_normal(self.stddev), self.par, self.real_vocab, axis=1)
        w = hk.get_parameter("w", [d_model, vs], init=init)
        return w, (hk.get_parameter("b", [vs], init=jnp.zeros) if self.bias else None)


def project(xf, w, b=None):
    """The output projection: xf [..., D] @ w [D, V/mp] (+ b [V/mp]) -> per-shard logits [..., V/mp]."""
    out = dense(xf, w)
    return out if b is None else out + b


def zero_padding(init, par: Parallel, vocab: int, axis: int):
    """``init`` with the vocabulary padding (global ids >= ``vocab`` along ``axis``) set to zero."""

    def padded(shape, dtype):
        w = init(shape, dtype)
        ids = par.vocab_start(shape[axis]) + jnp.arange(shape[axis])
        real = (ids < vocab).reshape([-1 if d == axis else 1 for d in range(len(shape))])
        return jnp.where(real, w, jnp.zeros((), w.dtype))

    return padded


def mask_vocab_padding(par: Parallel, logits, vocab_size: int):
    """logits [B, T, V/mp] per-shard, V padded -> the same with the padded columns (global ids >=
    ``vocab_size``) at -inf: out of the softmax of ``vocab_parallel_xent``, with zero gradient."""
    vs = logits.shape[-1]
    if vocab_size >= vs * par.layout.mp:
        return logits
    real = par.real_vocab_columns(vs, vocab_size)  # [V/mp]
    return jnp.where(real, logits, jnp.asarray(-jnp.inf, logits.dtype))


def vocab_parallel_xent(par: Parallel, logits, targets, z_loss: float = 0.0):
    """Softmax cross-entropy over a vocabulary split across shards, never gathering full logits.

    logits: [B, T, V/mp] per-shard (any float dtype; computed in float32); targets: [B, T] global ids.
    Returns per-token loss [B, T] (replicated). The global max comes from pmax under stop_gradient:
    it only shifts logits for stability, and log Z does not depend on it. A padded vocabulary's
    logits come masked (``mask_vocab_padding``): -inf adds exactly 0 to the sum of exponentials.
    """
    logits = upcast(logits)
    vs = logits.shape[-1]
    m = lax.stop_gradient(par.pmax(jnp.max(lax.stop_gradient(logits), axis=-1)))  # [B, T]
    local = targets - par.vocab_start(vs)
    inside = (local >= 0) & (local < vs)
    # The target's logit picked from the logits, then shifted (the very float op of picking it from the
    # shifted logits): the shifted [B, T, V/mp] then feeds the exponentials' sum alone and is fused
    # into it. Picked from it, XLA:TPU kept it as an array beside the logits: a second float32 logits
    # buffer in the step (llama-100m, batch 8 x 512: 256 MiB, scripts/step_memory.py --chip v5e).
    picked = jnp.take_along_axis(logits, jnp.where(inside, local, 0)[..., None], axis=-1)[..., 0] - m
    target_logit = par.g(jnp.where(inside, picked, jnp.zeros((), picked.dtype)))  # [B, T]
    log_sum = jnp.log(par.g(jnp.sum(jnp.exp(logits - m[..., None]), axis=-1)))  # [B, T]
    loss = log_sum - target_logit
    if z_loss:
        loss = loss + z_loss * jnp.square(log_sum + m)  # log Z = log_sum + m
    return loss


def gelu_tanh(x):
    """GELU's tanh approximation 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), computed as
    the equal x sigmoid(2u): no cancellation in 1 + tanh(u) where x < 0 (in float32 on [-4, 0), relative:
    ``jax.nn.gelu``'s up to 4e-3 off, torch's 7e-4, this 1e-6). A norm after the activation (Gemma's
    sandwich, Gemma 4's per-layer input) rescales small outputs, their error with them, to the logits
    (Gemma 4's float32 logits were 2.5e-5 off float64 by it, transformers' 1e-5, now 5e-6)."""
    return x * jax.nn.sigmoid(2 * math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))  # weak: x.dtype


# The gated MLPs' activations (of the gate): SwiGLU (Llama) and GeGLU with tanh GELU (Gemma's
# ``gelu_pytorch_tanh``).
GATED = {"swiglu": jax.nn.silu, "geglu": gelu_tanh}


class MLP(hk.Module):
    """Column-then-row-parallel feed-forward: w_in [D, F/mp] (+ b_in), act, w_out [F/mp, D].

    ``kind`` is "gelu" (two matmuls, biases optional), "swiglu" (silu(gate) * up, no biases) or
    "geglu" (Gemma: gelu_tanh(gate) * up, no biases).
    Returns (partial [B, T, D], bias [D] or None): the bias is added once, after the all-reduce.
    ``lora``: the ModelConfig whose LoRA adapters apply here (``model.lora``), or None.
    """

    def __init__(
        self,
        *,
        hidden_dim: int,
        par: Parallel,
        kind: str,
        bias: bool,
        stddev_in: float,
        stddev_out: float,
        lora=None,
        quant: str = "none",
        name: str = "mlp",
    ):
        super().__init__(name=name)
        if kind not in GATED and kind != "gelu":
            raise ValueError(f"MLP kind must be 'gelu', 'swiglu' or 'geglu', got {kind!r}")
        self.d_ff, self.par, self.kind, self.bias = hidden_dim, par, kind, bias
        self.stddev_in, self.stddev_out = stddev_in, stddev_out
        self.lora = lora  # the ModelConfig whose LoRA adapters apply here (``model.lora``), or None
        self.quant = quant  # "none" or "int8" (``model.quant``): how the weight matmuls multiply

    def _dense(self, name, x, cols, stddev, bias):
        w = hk.get_parameter(f"w_{name}", [x.shape[-1], cols], init=_normal(stddev))
        y = adapted(
            self.lora, self.par, f"mlp/w_{name}", x, matmul(self.par, self.quant, "col", x, w), x.shape[-1:]
        )
        return y + hk.get_parameter(f"b_{name}", [cols], init=jnp.zeros) if bias else y

    def __call__(self, xf):
        fl = self.d_ff // self.par.layout.mp
        if self.kind in GATED:
            # [B, T, F/mp]: the MLP's input projections, named for --remat save_qkv_mlp_in (``memory``)
            gate = checkpoint_name(self._dense("gate", xf, fl, self.stddev_in, False), "mlp_in")
            h = GATED[self.kind](gate) * checkpoint_name(
                self._dense("up", xf, fl, self.stddev_in, False), "mlp_in"
            )
            out_name = "down"
        else:
            h = gelu_tanh(checkpoint_name(self._dense("in", xf, fl, self.stddev_in, self.bias), "mlp_in"))
            out_name = "out"
        d = xf.shape[-1]
        w_out = hk.get_parameter(f"w_{out_name}", [fl, d], init=_normal(self.stddev_out))
        b_out = hk.get_parameter(f"b_{out_name}", [d], init=jnp.zeros) if self.bias else None
        out = matmul(self.par, self.quant, "row", h, w_out)  # [B, T, D] partial over mp
        return adapted(self.lora, self.par, f"mlp/w_{out_name}", h, out, h.shape[-1:]), b_out


class LayerNorm(hk.Module):
    """LayerNorm with scale and offset, computed in float32 (replicated parameters)."""

    def __init__(self, *, eps: float, name: str = "ln"):
        super().__init__(name=name)
        self.eps = eps

    def __call__(self, x):
        d = x.shape[-1]
        x32 = upcast(x)
        mean = jnp.mean(x32, -1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), -1, keepdims=True)
        y = (x32 - mean) * lax.rsqrt(var + self.eps)
        scale = hk.get_parameter("scale", [d], init=jnp.ones)
        offset = hk.get_parameter("offset", [d], init=jnp.zeros)
        return (y * scale + offset).astype(x.dtype)


class RMSNorm(hk.Module):
    """RMSNorm (Llama): x / rms(x) * scale, computed in float32 (replicated parameters)."""

    def __init__(self, *, eps: float, name: str = "ln"):
        super().__init__(name=name)
        self.eps = eps

    def normalized(self, x):
        """x / rms(x) in (at least) float32."""
        x32 = upcast(x)
        return x32 * lax.rsqrt(jnp.mean(jnp.square(x32), -1, keepdims=True) + self.eps)

    def __call__(self, x):
        scale = hk.get_parameter("scale", [x.shape[-1]], init=jnp.ones)
        return (scale * self.normalized(x).astype(x.dtype)).astype(x.dtype)


class RMSNormProductFirst(RMSNorm):
    """RMSNorm with the weight product in float32 before the cast (transformers' ``Olmo2RMSNorm``:
    ``(w * x_normed).to(dtype)``, where Llama casts first); the same as ``RMSNorm`` in float32."""

    def __call__(self, x):
        scale = hk.get_parameter("scale", [x.shape[-1]], init=jnp.ones)
        return (upcast(scale) * self.normalized(x)).astype(x.dtype)


class RMSNormPlusOne(RMSNorm):
    """Gemma's RMSNorm: x / rms(x) * (1 + scale), in float32 then cast (transformers' ``GemmaRMSNorm``:
    the product before the cast, unlike Llama's); ``scale`` starts at zero: the identity scale."""

    def __call__(self, x):
        scale = hk.get_parameter("scale", [x.shape[-1]], init=jnp.zeros)
        return (self.normalized(x) * (1.0 + upcast(scale))).astype(x.dtype)


def rotary_angles(positions, inv_freq: np.ndarray, dtype, scale: float = 1.0):
    """positions: [B, T] int; inv_freq [rot_dim // 2] (``ModelConfig.inv_freq``: plain or scaled
    RoPE) -> (cos, sin) each [B, T, rot_dim // 2], at least float32, times ``scale`` (YaRN's attention
    factor, ``rope.attention_scale``: 1 otherwise; a traced scalar where it is the layer kind's)."""
    dtype = jnp.promote_types(dtype, jnp.float32)
    ang = positions.astype(dtype)[..., None] * jnp.asarray(inv_freq, dtype)
    if isinstance(scale, float | int) and scale == 1.0:
        return jnp.cos(ang), jnp.sin(ang)
    scale = jnp.asarray(scale, dtype)
    return jnp.cos(ang) * scale, jnp.sin(ang) * scale


def rotation(rot_dim: int, style: str) -> np.ndarray:
    """[rot_dim, rot_dim] float32 numpy, the signed permutation P with x @ P = each dim's partner in its
    rotary pair, signed: "half" [x1, x2] -> [-x2, x1], "interleaved" (x0, x1, x2, ..) -> (-x1, x0, -x3, ..).
    One +-1 a column: each output is one input, exactly (the rest of its sum are zeros)."""
    h = rot_dim // 2
    p = np.zeros((rot_dim, rot_dim), np.float32)
    i = np.arange(h)
    if style == "interleaved":
        p[2 * i + 1, 2 * i], p[2 * i, 2 * i + 1] = -1, 1
    else:
        p[i + h, i], p[i, i + h] = -1, 1
    return p


def widened(t, style: str):
    """cos or sin [..., rot_dim / 2] -> [..., rot_dim], each angle at both dims of its pair."""
    return jnp.repeat(t, 2, axis=-1) if style == "interleaved" else jnp.concatenate([t, t], axis=-1)


def apply_rotary(x, cos, sin, rot_dim: int, style: str):
    """Rotate the first ``rot_dim`` dims of each head. x: [B, T, h, E]; cos/sin: [B, T, rot_dim/2].

    style "interleaved" (GPT-J): pairs (x0, x1), (x2, x3), ...; "half" (Llama): pairs (x_i, x_{i+r/2}).
    Computed on whole vectors, x * [c, c] + (x @ P) * [s, s] (``rotation``: P the signed swap of each
    pair; interleaved: c and s repeated), never on [.., r/2]-wide halves: with E = 128 a half is half a
    TPU vector register, and on the halves XLA:TPU kept the q/k norm, the rotary and the flash kernel's
    transpose in fusions of their own, 7.7 ms of a qwen3-0.6b layer at batch 8; with P they are one
    matmul fusion, 3.4 ms in all (docs/benchmarks.md, "Rotary on whole vectors"). Each output of x @ P
    is exactly one input, negated or not (HIGHEST precision: on a TPU a float32 x is not rounded to
    bf16), so this is the pairs formula x1 c - x2 s, x2 c + x1 s in every dtype (x1 c + (-x2) s is
    x1 c - x2 s in IEEE arithmetic): bit for bit op by op and compiled by XLA:CPU
    (tests/test_rope_whole.py), up to the sign of a zero; XLA:TPU's bf16 fusions keep other products
    in float32 than before (one bf16 rounding of a product apart). An inf in x makes its head's row
    NaN, not only its pair (0 x inf in x @ P)."""
    rot, rest = (x, None) if rot_dim == x.shape[-1] else (x[..., :rot_dim], x[..., rot_dim:])
    c, s = (widened(t[:, :, None, :].astype(x.dtype), style) for t in (cos, sin))  # [B, T, 1, rot_dim]
    p = jnp.asarray(rotation(rot_dim, style), x.dtype)
    partner = lax.dot_general(
        rot,
        p,
        (((rot.ndim - 1,), (0,)), ((), ())),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=x.dtype,
    )  # [B, T, h, rot_dim]: (-x2, x1) or (-x1, x0, ..)
    out = rot * c + partner * s
    return out if rest is None else jnp.concatenate([out, rest], axis=-1)
