"""The gated delta rule (Gated DeltaNet, Yang et al. 2024; Qwen3.5 / Qwen3-Next's linear attention): a
fixed-size state per value head, S [dk, dv], updated token by token as

    S <- a_t S                                   (decay a_t = exp(g_t), g_t <= 0; 0 at a document start)
    S <- S + k_t (beta_t (v_t - S^T k_t))^T      (the delta rule: write strength beta_t in (0, 1))
    o_t = S^T q_t

and its chunked form, which equals it (transformers' ``torch_chunk_gated_delta_rule``): inside a chunk
of C tokens the writes are one unit-lower-triangular solve (the UT transform), across chunks a scan
carries S. Also the causal depthwise convolution that precedes it, and q/k's L2 norm.

Shapes (per shard: value heads h = H_v/mp, their key heads already repeated to them):
q, k [B, T, h, dk]; v [B, T, h, dv]; g, beta [B, T, h]; state [B, h, dk, dv]; ``reset`` None or
[B, T] bool, True where a document starts (the state is zeroed before that token's write).
The module-level functions ``chunked_rule``, ``write_strength`` and ``document_resets`` are the hooks
``proof.family_faults`` plants its delta-rule controls in (the layer looks them up here when traced).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from meshlm.model.blockwise import varying_like

L2_EPS = 1e-6  # transformers' (and FLA's) l2norm: x * rsqrt(sum(x^2) + eps)


def l2norm(x):
    """x / ||x|| over the last axis, in at least float32 (as transformers: the FLA library's eps)."""
    x32 = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    return x32 * lax.rsqrt(jnp.sum(jnp.square(x32), -1, keepdims=True) + L2_EPS)


def write_strength(b):
    """beta = sigmoid(b): how much of the delta a token writes (a control drops the sigmoid)."""
    return jax.nn.sigmoid(b)


def document_resets(positions, starts):
    """[B, T] bool: the tokens where a document starts (``--doc-mask``'s ``starts``), or None without
    documents. Positions are absolute, so a row's first token of each document resets the state."""
    return None if starts is None else positions == starts


def causal_conv(x, w, positions=None, starts=None):
    """Depthwise causal convolution: x [B, T, C], w [K, C] (tap K-1 is the current token) -> [B, T, C],
    out_t = sum_j w[j] x_{t-K+1+j}; inputs before the row, or before the token's document start
    (``starts``), count as zeros (each document convolved alone)."""
    kernel, t = w.shape[0], x.shape[1]
    padded = jnp.pad(x, ((0, 0), (kernel - 1, 0), (0, 0)))
    out = jnp.zeros(x.shape, jnp.promote_types(x.dtype, w.dtype))
    for j in range(kernel):
        back = kernel - 1 - j  # how many tokens before the current one this tap reads
        xs = padded[:, j : j + t]
        if starts is not None and back:
            xs = jnp.where((positions - back >= starts)[..., None], xs, 0)
        out = out + xs * w[j]
    return out


def decay_first(state, a, k, v, beta):
    """One token's step of the rule: decay, then the delta write (a control writes before decaying).
    state [B, h, dk, dv]; a, beta [B, h]; k [B, h, dk]; v [B, h, dv]."""
    state = state * a[..., None, None]
    predicted = jnp.einsum("bhk,bhkv->bhv", k, state)
    delta = (v - predicted) * beta[..., None]
    return state + k[..., :, None] * delta[..., None, :]


def _prepared(q, k, g, reset):
    """q scaled by 1/sqrt(dk) (after its L2 norm, the caller's); the decay a = exp(g), 0 at resets."""
    q = q * (q.shape[-1] ** -0.5)
    a = jnp.exp(g)
    if reset is not None:
        a = jnp.where(reset[..., None], 0.0, a)
    return q, a


def recurrent_rule(q, k, v, g, beta, state, reset=None, update=decay_first):
    """The rule token by token (the reference and the decode) -> (out [B, T, h, dv], final state);
    ``update``: one token's step (a control plants one that writes before it decays)."""
    q, a = _prepared(q, k, g, reset)

    def step(s, xs):
        qt, kt, vt, at, bt = xs
        s = update(s, at, kt, vt, bt)
        return s, jnp.einsum("bhk,bhkv->bhv", qt, s)

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, a, beta))
    state, out = lax.scan(step, varying_like(state, *xs), xs)
    return jnp.moveaxis(out, 0, 1), state


def _solve(system, x):
    return lax.linalg.triangular_solve(system, x, left_side=True, lower=True, unit_diagonal=True)


def _one_at_a_time(system, x):
    """``_solve`` by a loop over the batch, one matrix per LAPACK call (see ``unit_lower_solve``)."""
    flat = lambda a: a.reshape(-1, *a.shape[-2:])
    return lax.map(lambda pair: _solve(*pair), (flat(system), flat(x))).reshape(x.shape)


def unit_lower_solve(system, x):
    """system^-1 x: system [..., C, C] unit lower-triangular, x [..., C, n] (the same batch dims).

    On CPU one matrix per call, because jaxlib 0.10's batched LAPACK solve (``lapack_?trsm_ffi``)
    splits a batch whose work passes ~2e5 flops over XLA's intra-op thread pool and blocks its own
    pool thread until the pieces are done. Devices on XLA:CPU run on that same pool: when every pool
    thread is such a waiting solve (the 4 devices of --mesh 1x2 --cp 2, brought to the solve together by
    the cp all-gather before it), no thread is left to run the pieces, and the step never returns
    (issue 59: C = 64, 2 heads of dk 16 + dv 12 a shard). A batch of one is never split. Each matrix
    goes through the same LAPACK call as before: the results are bitwise those of the batched call.
    Other backends solve the batch in one call (no LAPACK there)."""
    return lax.platform_dependent(system, x, cpu=_one_at_a_time, default=_solve)


def chunked_rule(q, k, v, g, beta, state, chunk: int, reset=None):
    """The rule in chunks of ``chunk`` tokens (transformers' chunked form; equal to ``recurrent_rule``)
    -> (out [B, T, h, dv], final state). A ragged last chunk is padded with tokens that neither decay
    nor write (g = 0, beta = 0, k = 0). Document resets enter as masks on the decays: a decay between
    two tokens of a chunk is zero when a reset lies between them (inclusive of the later one)."""
    b, t, h, dk = k.shape
    pad = -t % chunk
    n = (t + pad) // chunk
    q, _ = _prepared(q, k, g, None)
    reset = jnp.zeros((b, t), bool) if reset is None else reset

    def chunks(x, fill=0):  # [B, T, h, ...] -> [n, B, h, C, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
        x = x.reshape(b, n, chunk, *x.shape[2:])
        return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 2, 3) if x.ndim > 3 else jnp.moveaxis(x, 1, 0)

    qc, kc, vc, gc, bc = chunks(q), chunks(k), chunks(v), chunks(g), chunks(beta)
    # resets [n, B, C] -> the running count r of resets in the chunk up to each token, per head
    r = jnp.cumsum(chunks(reset, False).astype(jnp.int32), axis=-1)[:, :, None, :]  # [n, B, 1, C]
    cum = jnp.cumsum(gc, axis=-1)  # [n, B, h, C]: log of the decay from the chunk's start to each token
    lower = jnp.tril(jnp.ones((chunk, chunk), bool))
    same = (r[..., :, None] == r[..., None, :]) & lower  # no reset in (j, i]
    pair = jnp.where(same, jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :], 0.0)), 0.0)
    from_start = jnp.where(r == 0, jnp.exp(cum), 0.0)  # [n, B, h, C]: decay since the chunk's start
    to_end = jnp.where(r == r[..., -1:], jnp.exp(cum[..., -1:] - cum), 0.0)  # decay to the chunk's end
    kb = kc * bc[..., None]
    system = jnp.einsum("...ik,...jk->...ij", kb, kc) * pair
    strictly_lower = jnp.tril(jnp.ones((chunk, chunk), bool), -1)
    system = jnp.where(strictly_lower, system, 0.0) + jnp.eye(chunk, dtype=system.dtype)  # unit lower
    solve = lambda x: unit_lower_solve(system, x)
    new_values, k_decayed = solve(vc * bc[..., None]), solve(kb * from_start[..., None])
    attn = jnp.einsum("...ik,...jk->...ij", qc, kc) * pair  # within the chunk, causal
    q_read = qc * from_start[..., None]
    k_write = kc * to_end[..., None]
    chunk_decay = from_start[..., -1][..., None, None]  # [n, B, h, 1, 1]

    def step(s, xs):
        u, kd, qr, at, kw, cd = xs
        v_new = u - jnp.einsum("bhck,bhkv->bhcv", kd, s)
        out = jnp.einsum("bhck,bhkv->bhcv", qr, s) + jnp.einsum("bhij,bhjv->bhiv", at, v_new)
        return s * cd + jnp.einsum("bhck,bhcv->bhkv", kw, v_new), out

    xs = (new_values, k_decayed, q_read, attn, k_write, chunk_decay)
    state, out = lax.scan(step, varying_like(state, *xs), xs)  # typed as the chunks (inside shard_map)
    out = jnp.moveaxis(out, 3, 2).reshape(n, b, chunk, h, -1)  # [n, B, C, h, dv]
    return jnp.moveaxis(out, 0, 1).reshape(b, n * chunk, h, -1)[:, :t], state
