"""The mixture-of-experts feed-forward (``Family.moe``: Mixtral's sparse block) and its losses.

Per layer: a router (linear D -> E, computed in at least float32; with ``router_bias`` plus a bias),
then the family's router record (``model.routers.Router``: softmax or sigmoid scores, an optional
selection bias and expert groups, the top k with ties broken by the lowest expert id, the weights
renormalised where ``norm_topk_prob`` says and scaled); each expert a gated MLP (silu(x W_gate) * (x W_up),
or gpt-oss's clamped (up + 1) * gate * sigmoid(alpha * gate): ``expert_activation``; with ``expert_bias``
biases on both projections) with ``moe_d_ff`` hidden units split over mp exactly as the dense MLP's; the
output the combine-weighted sum of the k experts' outputs (partial over mp: the block adds it with
``par.row_out``), plus the shared experts' (``_shared``).

Parameters, inside the layer's module ``moe`` (global shapes; per shard the hidden units I are I/mp):
  router/w         [D, E]   replicated over mp (the routing is computed on the replicated input)
  router/b         [E]      gpt-oss's router bias (``router_bias``)
  router/balance_bias [E]   the selection bias (``balance_bias``: no gradient, ``model.routers``)
  router/scale     [D]      Gemma 4's: the router's input RMS-normed, times it and D^-0.5 (``router_norm``)
  router/expert_scale [E]   Gemma 4's ``per_expert_scale``: the chosen experts' weights times it
  experts/w_gate   [E, D, I] and experts/w_up [E, D, I]; experts/w_down [E, I, D]
  experts/b_gate, b_up [E, I]; experts/b_down [E, D] replicated (``expert_bias``, gpt-oss)
  shared/...       Qwen2-MoE's shared expert (the dense MLP module) gated by sigmoid(x @ shared_gate/w [D, 1])
  shared_experts/... ``n_shared_experts`` always-on experts, ungated: one dense MLP of n x moe_d_ff units

Where the communication is: the router runs on the normalized input *before* ``par.f`` (replicated over
mp, or with sp this shard's sequence slice), so its weight's gradient needs no mp sum; the combine
weights and expert ids then enter the column-parallel region with ``par.f`` like the input (an mp sum of
the weights' gradient in the backward: the experts' partial outputs meet them). The experts are
reached through the seam ``par.experts(x, ids, weights, expert_fn)`` (``parallel.experts``): all local
by default, split over ``ep`` where that axis is on.

Capacity (``moe_capacity_factor`` C > 0; ``capacity_keep``): each expert takes at most
min(N, ceil(C x N x k / E)) of the N tokens' k choices of one forward's global batch; GShard's rule decides
which, on the whole batch: every token's first choice before any second one, and within a rank the
tokens in global order (batch row, then position). A dropped choice contributes 0 (its combine weight
is zeroed, the others are not renormalised: GShard, Switch); the token keeps its other choices. Each
shard gathers the routing ids of the whole batch (with each token's global place, so cp's chunk order
does not matter) and takes its own tokens' keep mask: the result does not depend on dp, ep, sp or cp.
The sorted dispatch then computes each expert's kept choices in buffers [E, capacity, D]
(``parallel.grouped``): capacity cuts the compute. A forward with a KV cache (generation) is
dropless: a decode step has no batch to rank.

Losses (``aux_loss``): per layer each shard returns the statistics of its own tokens (``STATS``); they
leave the layer stack as per-layer outputs, are summed over the whole global batch (``par.moe_sum``)
and only then formed into the load-balancing and z losses, so the loss does not depend on the layout.
"""

from __future__ import annotations

import math
from fractions import Fraction

import haiku as hk
import jax
import jax.numpy as jnp
from jax import lax

from meshlm.model.layers import GATED, MLP, upcast
from meshlm.model.quant_experts import int8_grouped
from meshlm.model.routers import BIAS, Router
from meshlm.parallel.context import Parallel
from meshlm.parallel.gmm_tiling import parse_tiling
from meshlm.parallel.grouped_int import equal_groups

# The router's path suffix: a matmul weight replicated over mp (under sp its gradient is summed over mp,
# as a norm's: ``perf.memory_collectives``).
ROUTER = "moe/router/w"


def _params(scope: str, shapes: dict, stddev: float) -> list:
    """The parameters ``scope/name`` of the calling module, in the order of ``shapes`` (one scope: a
    second would be named ``scope_1``; a function, not a method: Haiku names a method's scope after it).
    Weights (``w*``) start truncated-normal, scales (``*scale``) at 1, biases (the other names) at 0."""
    init = hk.initializers.TruncatedNormal(stddev=stddev)
    with hk.name_scope(scope):
        return [
            hk.get_parameter(name, shape, init=init if name.startswith("w") else _zero_or_one(name))
            for name, shape in shapes.items()
        ]


def _zero_or_one(name: str):
    return jnp.ones if name.endswith("scale") else jnp.zeros


def route(logits, k: int, router: Router, bias=None, tap=lambda name, x: x, scale=None):
    """logits [.., E] (float32 or wider) -> (scores [.., E], combine weights [.., k], ids [.., k] int32):
    the family's router record (``model.routers``); ``bias`` the selection bias [E] or None; ``scale``
    the experts' learned scales [E] or None."""
    return router(logits, k, bias, tap, scale)


def expert_activation(cfg):
    """(gate, up) [.., I] -> the experts' gated hidden units: silu(gate) * up (``expert_glu`` "geglu":
    gelu_tanh(gate) * up, Gemma 4's); with ``swiglu_limit`` the
    gate clamped above and up on both sides first, with ``swiglu_alpha`` gpt-oss's
    (up + 1) * gate * sigmoid(alpha * gate) (transformers' ``GptOssExperts._apply_gate``)."""
    limit, alpha = cfg.swiglu_limit, cfg.swiglu_alpha

    def act(gate, up):
        if limit:
            gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
        if alpha:
            return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))
        return GATED[cfg.expert_glu](gate) * up

    return act


def statistics(logits, probs, ids, n_experts: int, keep=None):
    """One layer's routing statistics over this shard's tokens, [2E + 3] (``STATS``): tokens sent to
    each expert (k choices per token, before any is dropped), the summed router probabilities of each
    expert, the summed squared log-partition (router z-loss), the number of tokens and the number of
    token-choices dropped by the capacity (``keep`` [.., k] bool; None: dropless, 0)."""
    flat = lambda a: a.reshape(-1, a.shape[-1])
    counts = jnp.sum(jax.nn.one_hot(flat(ids), n_experts, dtype=probs.dtype), axis=(0, 1))
    prob_sums = jnp.sum(flat(probs), axis=0)
    z = jnp.sum(jnp.square(jax.nn.logsumexp(flat(logits), axis=-1)))[None]
    tokens = jnp.full((1,), flat(ids).shape[0], probs.dtype)
    dropped = jnp.zeros((1,), probs.dtype) if keep is None else jnp.sum(~keep, dtype=probs.dtype)[None]
    return jnp.concatenate([lax.stop_gradient(counts), prob_sums, z, tokens, dropped])


def capacity(cfg, tokens: int) -> int:
    """Token-choices each expert takes of a forward's ``tokens`` (global): ceil(C x tokens x k / E),
    C read as the decimal it was written as (0.1 is 1/10, not the float just above it), at most
    ``tokens``: an expert is among a token's k choices at most once, so C >= E / k keeps every choice
    (the clamp changes no mask, and keeps the bound an int32 whatever C: 1e30 is "never drop")."""
    c = Fraction(repr(cfg.moe_capacity_factor))
    return min(tokens, math.ceil(c * tokens * cfg.experts_per_token / cfg.n_experts))


def capacity_keep(cfg, par: Parallel, ids):
    """ids [B, T', k] this shard's routed tokens' expert ids -> keep [B, T', k] bool, or None when
    dropless (C = 0). GShard's rule on the whole global batch (module docstring): every shard gathers
    all tokens' ids with their global places (``par.moe_gather``, ``par.moe_token_keys``), ranks each
    expert's token-choices (choice rank, then global token order) and keeps the first ``capacity``;
    then looks up its own tokens. Integer work only: exact, and no gradient."""
    if not cfg.moe_capacity_factor:
        return None
    b, t, k = ids.shape
    keys = par.moe_token_keys(b, t).reshape(-1)  # [n]
    every = par.moe_gather(jnp.concatenate([keys[:, None], ids.reshape(-1, k)], axis=-1))  # [N, 1 + k]
    order = jnp.argsort(every[:, 0])
    ranked = every[order, 1:].T  # [k, N]: the choices in the rule's order, rank-major
    hot = jax.nn.one_hot(ranked, cfg.n_experts, dtype=jnp.int32).reshape(-1, cfg.n_experts)
    before = jnp.sum((jnp.cumsum(hot, axis=0) - hot) * hot, axis=-1)  # earlier choices of that expert
    kept = (before < capacity(cfg, every.shape[0])).reshape(k, -1)  # [k, N] in global token order
    mine = jnp.searchsorted(every[order, 0], keys)  # [n]: this shard's tokens among them
    return kept[:, mine].T.reshape(b, t, k)


class Experts:
    """The experts' gated MLPs on per-expert token buffers: [E_here, C, D] -> [E_here, C, D], partial
    over mp (each shard holds I/mp hidden units of every expert). ``n_local``: E_here, the experts this
    shard holds (the leading dim of its expert weights); ``dispatch``: how tokens reach them
    (``parallel.grouped``); ``capacity``: each expert's bound on the global batch's choices (0: dropless);
    ``weights`` and ``hidden`` (``expert_activation``: the gated hidden units of gate and up) for the
    grouped matmuls; ``b_gate``, ``b_up`` [E_here, I/mp]: the projections' biases (None: none; the down
    bias is ``MoE``'s), each row's expert's added in every dispatch (``biases``: the pair, or ());
    ``tiling``: "gmm"'s kernel tiles (tm, tk, tn), None: chosen from the shapes (``parallel.gmm_kernel``);
    ``quant`` "int8": the three matmuls int8 in the ``Parallel`` context ``par`` (``rows``)."""

    def __init__(
        self,
        w_gate,
        w_up,
        w_down,
        dispatch="dense",
        capacity=0,
        b_gate=None,
        b_up=None,
        act=None,
        tiling=None,
        quant="none",
        par=None,
    ):
        self.weights, self.tiling = (w_gate, w_up, w_down), tiling
        self.b_gate, self.b_up = b_gate, b_up
        self.hidden = act or (lambda gate, up: jax.nn.silu(gate) * up)
        self.n_local, self.dispatch, self.capacity = w_gate.shape[0], dispatch, capacity
        self.quant, self.par = quant, par

    @property
    def biases(self) -> tuple:
        """(b_gate, b_up) [E_here, I/mp], or () without expert biases."""
        return () if self.b_gate is None else (self.b_gate, self.b_up)

    def __call__(self, xs):
        if self.quant == "int8":  # [E, C, D]: E groups of C rows
            e, c, d = xs.shape
            return self.rows(xs.reshape(e * c, d), equal_groups(e, c)).reshape(e, c, -1)
        w_gate, w_up, w_down = self.weights
        gate = jnp.einsum("ecd,edi->eci", xs, w_gate)
        up = jnp.einsum("ecd,edi->eci", xs, w_up)
        if self.b_gate is not None:
            gate, up = gate + self.b_gate[:, None], up + self.b_up[:, None]
        return jnp.einsum("eci,eid->ecd", self.hidden(gate, up), w_down)

    def rows(self, xs, groups):
        """``quant`` "int8": rows [R, D] grouped by expert (``groups``: ``parallel.grouped_int``, the
        dispatch's integer grouped dots) through their experts' gated MLPs, each matmul int8 x int8 ->
        int32 (``model.quant_experts``) -> [R, D] partial over mp; biases added by each row's expert."""
        w_gate, w_up, w_down = self.weights
        gate, up = int8_grouped(self.par, "col", xs, (w_gate, w_up), groups)  # [R, I/mp] each: one matmul
        if self.b_gate is not None:
            gate, up = gate + self.b_gate[groups.expert], up + self.b_up[groups.expert]
        return int8_grouped(self.par, "row", self.hidden(gate, up), (w_down,), groups)[0]


class MoE(hk.Module):
    """xn [B, T', D] (the normalized input before ``par.f``: replicated over mp, or with sp this shard's
    slice [B, T/mp, D]) -> (partial output [B, T, D] for ``par.row_out``, statistics [2E + 3]). The
    router reads ``router_in`` (of xn's shape; Gemma 4's: the residual stream), by default xn."""

    def __init__(self, *, cfg, par: Parallel, stddev: float, dropping: bool = True, name: str = "moe"):
        super().__init__(name=name)
        self.cfg, self.par, self.stddev = cfg, par, stddev
        self.dropping = dropping  # the capacity applies (not with a KV cache: module docstring)

    def __call__(self, xn, router_in=None):
        cfg, par = self.cfg, self.par
        d, e, k = xn.shape[-1], cfg.n_experts, cfg.experts_per_token
        # [B, T', E], at least float32 (float64 under --x64)
        logits, bias, scale = _router(cfg, xn if router_in is None else router_in, self.stddev)
        probs, weights, ids = route(logits, k, Router.of(cfg), bias, par.tap, scale)
        keep = capacity_keep(cfg, par, ids) if self.dropping else None
        if keep is not None:  # a dropped choice's weight 0: its expert output contributes exactly 0
            weights = jnp.where(keep, weights, jnp.zeros((), weights.dtype))
        stats = statistics(logits, probs, ids, e, keep)
        cap = 0
        if keep is not None:  # a dropped choice goes to no expert (id -1); its bound on the whole batch
            ids, cap = jnp.where(keep, ids, -1), capacity(cfg, math.prod(ids.shape[:2]) * par.moe_shards())
        xf, ids = par.f(xn), par.f(ids)  # [B, T, ...]: the column-parallel region's view
        weights = par.tap("combine_weights", par.f(weights))  # its gradient: the mp sum of the partials
        el, fl = par.local_experts(e), cfg.moe_d_ff // par.layout.mp
        shapes = {"w_gate": [el, d, fl], "w_up": [el, d, fl], "w_down": [el, fl, d]}
        if cfg.expert_bias:
            shapes.update(b_gate=[el, fl], b_up=[el, fl], b_down=[e, d])
        w_gate, w_up, w_down, *biases = _params("experts", shapes, self.stddev)
        act = expert_activation(cfg)
        tiling = parse_tiling(cfg.moe_gmm_tiling)
        experts = Experts(
            w_gate,
            w_up,
            w_down,
            cfg.moe_dispatch,
            cap,
            *biases[:2],
            act=act,
            tiling=tiling,
            quant=cfg.quant,
            par=par,
        )
        b, t = xf.shape[:2]
        xe = xf  # what the experts see: with ``weights_on_input`` (Llama 4, top-1) x times its weight
        if cfg.weights_on_input:
            xe, weights = xf * weights.astype(xf.dtype), jnp.ones_like(weights)
        out = par.experts(xe.reshape(b * t, d), ids.reshape(b * t, k), weights.reshape(b * t, k), experts)
        out = out.reshape(b, t, d)
        if biases:  # each chosen expert's down bias, weighted: once, on mp shard 0's partial
            down = jnp.sum(weights[..., None] * biases[2][ids].astype(weights.dtype), axis=-2)
            out = out + jnp.where(par.shard_index() == 0, down, jnp.zeros_like(down)).astype(out.dtype)
        if cfg.n_shared_experts or cfg.shared_expert_d_ff:
            out = out + _shared(cfg, par, xf, self.stddev)
        return out, stats


def _router(cfg, xr, stddev: float):
    """The router's parameters made, then ``router_logits``. A function: Haiku would name a method's
    scope after it."""
    e, d = cfg.n_experts, xr.shape[-1]
    shapes = {"w": [d, e], **({"b": [e]} if cfg.router_bias else {})}
    shapes.update({BIAS: [e]} if cfg.balance_bias else {})
    shapes.update({"scale": [d]} if cfg.router_norm else {})
    shapes.update({"expert_scale": [e]} if cfg.expert_scale else {})
    return router_logits(cfg, xr, dict(zip(shapes, _params("router", shapes, stddev), strict=True)))


def router_logits(cfg, xr, named: dict):
    """The router's logits [B, T', E] (at least float32) of its input xr [B, T', D], the selection bias
    [E] (its gradient stopped: balancing moves it, ``model.routers``) and the experts' scales [E]
    (None without them), from its parameters ``named`` (``w`` and the optional ones, by name). With
    ``router_norm`` xr RMS-normed without a weight, times ``scale`` [D] and D^-0.5 first (Gemma 4's)."""
    x = upcast(xr)
    if cfg.router_norm:
        x = x * lax.rsqrt(jnp.mean(jnp.square(x), -1, keepdims=True) + cfg.norm_eps)
        x = x * upcast(named["scale"]) * (x.shape[-1] ** -0.5)
    logits = x @ upcast(named["w"])
    if cfg.router_bias:
        logits = logits + upcast(named["b"])
    bias = lax.stop_gradient(upcast(named[BIAS])) if cfg.balance_bias else None
    return logits, bias, named.get("expert_scale")


def _shared(cfg, par: Parallel, xf, stddev: float):
    """The shared experts' output [B, T, D] partial over mp like the experts' (each shard holds 1/mp of
    their hidden units; the block's ``par.row_out`` sums both once): ``n_shared_experts`` always on,
    ungated (one MLP of n x moe_d_ff units: the n experts' sum), and Qwen2-MoE's ``_gated_shared``."""
    parts = []
    if cfg.n_shared_experts:
        width = cfg.n_shared_experts * cfg.moe_d_ff
        mlp = MLP(hidden_dim=width, par=par, kind="swiglu", bias=False, stddev_in=stddev, stddev_out=stddev,
                  quant=cfg.quant, name="shared_experts")  # fmt: skip
        parts.append(mlp(xf)[0])
    if cfg.shared_expert_d_ff:
        parts.append(_gated_shared(cfg, par, xf, stddev))
    return sum(parts[1:], parts[0])


def _gated_shared(cfg, par: Parallel, xf, stddev: float):
    """Qwen2-MoE's shared expert: a dense gated MLP on every token, times sigmoid(xf @ gate) -> [B, T, D]
    partial over mp like the experts' output. The gate [D, 1] is replicated over mp and computed on the
    column-parallel view xf (the whole sequence under sp too): each shard's gradient of it is its
    partial's share, summed over mp by JAX (the replicated weight meets mp-varying values)."""
    shared, _ = MLP(
        hidden_dim=cfg.shared_expert_d_ff,
        par=par,
        kind="swiglu",
        bias=False,
        stddev_in=stddev,
        stddev_out=stddev,
        quant=cfg.quant,
        name="shared",
    )(xf)
    (gate,) = _params("shared_gate", {"w": [xf.shape[-1], 1]}, stddev)
    gate = par.tap("shared_gate", gate)
    return par.tap("shared_expert", shared * jax.nn.sigmoid(upcast(xf) @ upcast(gate)).astype(shared.dtype))


def stats_size(cfg) -> int:
    """The length of one layer's statistics vector (``statistics``)."""
    return 2 * cfg.n_experts + 3


def split_stats(cfg, stats):
    """[L, 2E + 3] -> (tokens per expert [L, E], summed probabilities [L, E], summed z [L], tokens [L])."""
    e = cfg.n_experts
    return stats[:, :e], stats[:, e : 2 * e], stats[:, 2 * e], stats[:, 2 * e + 1]


def dropped_choices(cfg, stats):
    """[L, 2E + 3] -> [L]: the token-choices the capacity dropped in each layer (0 dropless)."""
    return stats[:, 2 * cfg.n_experts + 2]


def balance_loss(cfg, stats):
    """The load-balancing loss of statistics summed over the whole global batch, [L, 2E + 3].

    "hf" (transformers' ``load_balancing_loss_func``): every layer's tokens pooled, E * sum_e f_e P_e
    with f_e the expert's chosen count over the L*N tokens (k choices per token: = k when balanced)
    and P_e its mean router probability; "per-layer" (Megatron's): per layer E * sum_e f_e P_e
    with f_e the fraction of the N*k choices (= 1 when balanced), then the mean over layers."""
    counts, prob_sums, _, tokens = split_stats(cfg, stats)
    e = cfg.n_experts
    if cfg.moe_aux_loss == "hf":
        total = jnp.sum(tokens)
        return e * jnp.sum(jnp.sum(counts, 0) / total * (jnp.sum(prob_sums, 0) / total))
    per_token = counts / (tokens[:, None] * cfg.experts_per_token)
    return jnp.mean(e * jnp.sum(per_token * prob_sums / tokens[:, None], axis=-1))


def z_loss(cfg, stats):
    """The router z-loss: the mean over every token and layer of logsumexp(router logits)^2."""
    _, _, z, tokens = split_stats(cfg, stats)
    return jnp.sum(z) / jnp.sum(tokens)


def moe_losses(cfg) -> bool:
    """Whether the loss uses the routing statistics: a mixture of experts with an aux or z-loss on."""
    return bool(cfg.arch.moe and (cfg.router_aux_loss_coef or cfg.router_z_loss_coef))


def aux_loss(cfg, stats):
    """What the MoE layers add to the loss: router_aux_loss_coef * the balance loss + router_z_loss_coef
    * the z-loss, of statistics summed over the whole global batch ([L, 2E + 3])."""
    out = jnp.zeros((), stats.dtype)
    if cfg.router_aux_loss_coef:
        out = out + cfg.router_aux_loss_coef * balance_loss(cfg, stats)
    if cfg.router_z_loss_coef:
        out = out + cfg.router_z_loss_coef * z_loss(cfg, stats)
    return out


def moe_layer(cfg, par: Parallel, *, norm, attention, stddev: float):
    """The sequential block with the MoE feed-forward: x -> (x, cache, statistics [2E + 3]).
    ``norm(name)`` builds the family's norm, ``attention()`` its attention module."""

    def layer(x, positions, cache=None, starts=None, kind=None):
        attn, cache = attention()(par.f(norm("ln")(x)), positions, cache, starts, kind)
        x = x + par.row_out(attn)
        out, stats = MoE(cfg=cfg, par=par, stddev=stddev, dropping=cache is None)(norm("ln2")(x))
        return x + par.row_out(out), cache, stats

    return layer
