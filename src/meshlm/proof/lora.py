"""``meshlm verify --lora-rank R``: LoRA adapters (``model.lora``) proven equal to the unsharded run.

The problem is the model's own with adapters on its targets, A and B both drawn at random (B = 0, the
training start, would leave A's gradient zero and prove nothing of it; ``drawn_adapters`` sizes the
term as its base's), alpha != R so that the scale is not 1. The tolerance is the proof's rtol times
the adapters' kappa (``tolerance_factor``; docs/proof.md "LoRA's tolerance"). Beyond the values
(loss and every adapter's gradient, in float64 under every mesh), these rows (``lora_rows``):

* only adapter gradients: every base parameter's gradient is exactly 0 in both runs (the base is read
  through ``stop_gradient``; the train step takes the adapters' alone, ``optim.trainable``), and some
  adapter's is not;
* the merged weights' forward (W + (alpha / R) A B, ``lora.merged`` at the proof's own alpha / R, the
  model without adapters) equals the adapted forward at the proof's tolerance (unsharded logits): a
  wrong scale both runs share shows here;
* with B = 0 the adapted model's logits are the base model's at the proof's tolerance (the adapter's
  term is exactly 0; the two compiled programs may round apart, in float32);
* with ``--steps K`` (AdamW of the adapters alone, as training's step: ``train.optim.trainable``; every
  adapter and its AdamW state compared after each step like any leaf): every frozen base leaf of the
  sharded run is bitwise its start after the K steps.

Controls (each changes the sharded run only): B's gradient not summed over the data shards (one
shard's kept: where the batch is split over dp or cp); the scale alpha / R applied twice (where it is
not 1); the scale alpha, not alpha / R (where R != 1). The
controls that fault only a frozen weight's gradient (an FSDP slice's reduce-scatter, a norm's or a
tied table's gradient sum) cannot change an adapter's gradient and are left out (``for_lora``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from meshlm.model import lora
from meshlm.model.lora_dropout import ROW_PARALLEL
from meshlm.model.params import is_stacked, param_path
from meshlm.parallel.context import Parallel
from meshlm.parallel.placement import to_host
from meshlm.proof.control_record import Control, replaced
from meshlm.proof.report import check_row
from meshlm.proof.taps import Tapped


def lora_problem(problem, base_dtype: str = "float32"):
    """``problem`` (a ``model_problem`` of a config with adapters) with A and B drawn at random, sized so
    that each adapter's term (alpha / R) A B is as large as its base weight's (``drawn_adapters``);
    ``base_dtype`` bf16 (``--base-dtype``): the base stored in bfloat16 in both runs
    (``train.lora.stored_base``), the adapters in the proof's dtype; each step casts the base up to it
    (``sharding.spmd.compute_params``): under --x64 the base's values are bf16-representable and
    everything computes in float64."""
    from meshlm.train.lora import stored_base

    before = problem.prepare_params

    def prepare(params):
        params = before(params) if before is not None else params
        return stored_base(lora.combine(lora.base(params), drawn_adapters(problem.cfg, params)), base_dtype)

    kind = "" if base_dtype == "float32" else f", a {base_dtype} base"
    return dataclasses.replace(problem, prepare_params=prepare, name=f"{problem.name} (LoRA{kind})")


def drawn_adapters(cfg, params) -> dict:
    """Random A and B for every adapter of ``params``: A ~ N(0, 1 / fan_in) (the size of training's
    kaiming A), B ~ N(0, sigma_B^2) with scale * sigma_A * sigma_B * sqrt(R) = the base weight's RMS, so
    that (alpha / R) A B, whose entries sum R products, has the base weight's entry size at every rank
    and alpha: the adapter's term counts in every output as much as the base's (a fault in it moves the
    result as far), and the proof's own problem is no worse conditioned at alpha 128, R 1 than at
    alpha 8, R 4 (``tolerance_factor``: kappa about 3.6 for these draws)."""
    rng = np.random.default_rng(0x10BA)
    out = {}
    for mod, leaves in lora.adapters(params).items():
        out[mod] = {}
        for name in sorted(n for n in leaves if n.endswith("_a")):
            a, b = leaves[name], leaves[name[:-2] + "_b"]
            w = np.asarray(to_host(params[mod][name[len(lora.ADAPTER) : -2]]), np.float64)
            fan_in = math.prod(a.shape[(1 if _stacked(mod) else 0) : -1])  # [L?, *in, R]
            sigma_a = 1 / math.sqrt(fan_in)
            sigma_b = float(np.sqrt(np.mean(w**2))) / (_scale(cfg) * sigma_a * math.sqrt(cfg.lora_rank))
            for n, x, sigma in ((name, a, sigma_a), (name[:-2] + "_b", b, sigma_b)):
                out[mod][n] = jax.device_put(sigma * rng.standard_normal(x.shape), x.sharding).astype(x.dtype)
    return out


def _stacked(mod: str) -> bool:
    """Whether the module's weights carry a leading layer dimension."""
    return is_stacked(param_path(mod, "w"))


def _scale(cfg) -> float:
    """alpha / R from the config's fields, computed here (not ``lora_scale``): the proof's own account
    of the scale, so that a wrong ``lora_scale`` (alpha alone, say) shows in the merged row."""
    return (cfg.lora_alpha or cfg.lora_rank) / cfg.lora_rank


def amplification(cfg, params) -> float:
    """kappa: how much larger the terms a targeted layer sums are with its adapter than without it, the
    worst over targets and layers. A layer computes y = x W + s (x A) B (s = alpha / R); rounding errs
    by a few units of the largest element of the terms summed, and for an input x each output column
    j's terms are bounded by ||x||_inf times sum_i |W_ij| without the adapter and sum_i |W_ij| +
    s (|A| |B|)_ij with it. So kappa = max_j (sum_i |W_ij| + s sum_i (|A||B|)_ij) / max_j sum_i |W_ij|
    (1 where B = 0: the training start, a model of the base's conditioning)."""
    s, kappa = _scale(cfg), 1.0
    for mod, leaves in lora.adapters(params).items():
        for name in [n for n in leaves if n.endswith("_a")]:
            w = np.abs(np.asarray(to_host(params[mod][name[len(lora.ADAPTER) : -2]]), np.float64))
            a = np.abs(np.asarray(to_host(leaves[name]), np.float64))
            b = np.abs(np.asarray(to_host(leaves[name[:-2] + "_b"]), np.float64))
            r, lead = a.shape[-1], (1 if _stacked(mod) else 0)
            a = a.reshape(*a.shape[:lead], -1, r)  # [L, in, R]
            b = b.reshape(*b.shape[:lead], r, -1)  # [L, R, out] (a replicated KV head's B: its own out)
            w = w.reshape(*w.shape[:lead], a.shape[-2], -1)  # [L, in, out]
            base_cols = w.sum(axis=-2)  # [L, out]
            with_adapter = base_cols + s * (a.sum(axis=-2)[..., None, :] @ b)[..., 0, :]
            worst = with_adapter.max(axis=-1) / np.maximum(base_cols.max(axis=-1), 1e-300)  # per layer
            kappa = max(kappa, float(np.max(worst)))
    return kappa


def tolerance_factor(cfg, params) -> float:
    """The factor of the proof's rtol for a model with adapters (1 without): kappa (``amplification``).
    The base model's rtol covers what its own network makes of each layer's rounding; an adapter
    multiplies that rounding by kappa at the layer that sums its term, so the loss and every gradient
    are compared at kappa times rtol. Measured: tiny-llama 1x2 with A and B at 0.5 N(0, 1), alpha 32,
    R 4 (kappa ~ 690) erred by 2e-12 where the base's rtol is 1e-12: within kappa x rtol by ~300x; the
    planted faults still 1e8 tolerances away (scripts/lora_sweep.py sweeps it)."""
    if cfg is None or not cfg.lora_rank:
        return 1.0
    return amplification(cfg, params)


class LoraBNotSummedOverDp(Tapped):
    """B's gradient not summed over the data shards: the one of the first shard (of dp, and cp) kept."""

    def lora_b(self, b):
        axes = self.layout.batch_axes
        first = lax.axis_index(axes) == 0
        return lax.stop_gradient(b) + jnp.where(first, b - lax.stop_gradient(b), jnp.zeros_like(b))


class LoraDropoutSameOnEveryDataShard(Tapped):
    """Each data shard numbers its tokens' dropout seeds as the first shard does: the same masks on
    every data shard (a key drawn per shard, not per global token)."""

    def lora_seeds(self, s):
        first = s.reshape(-1)[0]
        return s - first + lax.pmin(first, self.layout.batch_axes)


class LoraDropoutFeaturesFromZero(Tapped):
    """A row-parallel target's input features (split over mp) numbered from 0 on every mp shard."""

    def lora_feature_offset(self, offset):
        return jnp.zeros_like(offset)


class LoraScaleTwice(Tapped):
    """The adapter's scale alpha / R applied twice."""

    def lora_scale(self, s):
        return s * s


def _lora(w) -> bool:
    return w.cfg is not None and bool(w.cfg.lora_rank)


def _dropout(w) -> bool:
    return _lora(w) and bool(w.cfg.lora_dropout)


def _data_shards(w) -> int:
    return math.prod(w.layout.shape[a] for a in w.layout.batch_axes)


LORA_CONTROLS = (
    Control(
        name="LoRA B gradient not summed over the data shards",
        applies=lambda w: _lora(w) and _data_shards(w) > 1,
        par_cls=LoraBNotSummedOverDp,
    ),
    Control(
        name="LoRA dropout: the same mask on every data shard",
        applies=lambda w: _dropout(w) and _data_shards(w) > 1,
        par_cls=LoraDropoutSameOnEveryDataShard,
    ),
    Control(
        name="LoRA dropout: a row-parallel input's features numbered per mp shard",
        applies=lambda w: (
            _dropout(w) and w.layout.mp > 1 and bool(ROW_PARALLEL & set(w.cfg.lora_targets.split(",")))
        ),
        par_cls=LoraDropoutFeaturesFromZero,
    ),
    Control(
        name="LoRA scale alpha/R applied twice",
        applies=lambda w: _lora(w) and w.cfg.lora_scale != 1,
        par_cls=LoraScaleTwice,
    ),
    # alpha where alpha / R belongs: R times the term, at any alpha (alpha == R too); at R = 1 the two
    # are the same number, nothing to detect
    Control(
        name="LoRA scale alpha, not alpha/R",
        applies=lambda w: _lora(w) and w.cfg.lora_rank != 1,
        cfg_change=lambda c: c.replace(lora_alpha=(c.lora_alpha or c.lora_rank) * c.lora_rank),
    ),
)
# Controls whose fault reaches only a frozen weight's gradient: under LoRA nothing can show them (each
# was seen "not detected", the others detected, by ``verify --lora-rank`` on 2x2 with --fsdp --sp).
FROZEN_ONLY = (
    "FSDP gradient kept from one data shard",  # a base weight's slice
    "SP norm gradients not summed over mp",  # the norms' scales
    "q/k norm gradient not summed over mp",  # Qwen3's q/k norm weights
    "tied head's gradient not added to the embedding",  # the embedding table
    "MoE shared expert's gate gradient not summed over mp",  # the shared expert's gate
    "an expert's gradient not summed over the data shards outside ep",  # the experts
)


@contextlib.contextmanager
def thawed():
    """While a program traces: the base read without ``lax.stop_gradient`` (``lora.freeze`` a no-op), so
    every parameter has its gradient, the frozen ones' too (``control_runs.frozen_reach``)."""
    import meshlm.model.pieces as pieces
    import meshlm.model.transformer as transformer

    plain = lambda cfg: contextlib.nullcontext()
    with replaced(vars(pieces), "freeze", plain), replaced(vars(transformer), "freeze", plain):
        yield


def for_lora(controls):
    """``controls`` less those that fault only a frozen base weight's gradient, where the model has
    adapters (they apply as before without)."""
    return tuple(
        dataclasses.replace(c, applies=lambda w, c=c: c.applies(w) and not _lora(w))
        if c.name in FROZEN_ONLY
        else c
        for c in controls
    )


def _logits(cfg, params, tokens, dtype):
    """The unsharded logits, every parameter cast to ``dtype`` (the proof's: a bf16 base's values in
    it, as the step computes them)."""
    from meshlm.model.transformer import logits_fn

    params = jax.tree.map(lambda p: p.astype(dtype), params)
    return hk.without_apply_rng(hk.transform(logits_fn(cfg, Parallel()))).apply(params, tokens)


def _base_kept(runs) -> list[dict]:
    """After the proof's training steps (none: []): ``base_kept`` of the sharded run."""
    trained = getattr(runs, "trained", None)
    return [] if trained is None else base_kept(runs.problem.cfg, runs.params, trained)


def base_kept(cfg, start, end) -> list[dict]:
    """With adapters (else []): a row, every frozen base leaf of ``end`` (the sharded parameters after
    the proof's steps) bitwise its ``start``. A mixture of experts' selection bias is state its own rule
    moves (``balance_update``), not a trained weight: left out."""
    if cfg is None or not cfg.lora_rank:
        return []
    start, end = lora.base(start), lora.base(end)
    moved = [
        f"{m}/{n}"
        for m, leaves in start.items()
        for n, x in leaves.items()
        if n != "balance_bias" and not np.array_equal(to_host(x), to_host(end[m][n]))
    ]
    detail = (
        f"moved: {moved}" if moved else f"{sum(map(len, start.values()))} base leaves bitwise their start"
    )
    return [check_row("LoRA: frozen base unchanged by the steps", not moved, detail)]


def lora_rows(runs, sharded_grads, rtol: float) -> list[dict]:
    """[] without adapters; else the rows of the module docstring (``rtol``: the proof's)."""
    cfg = runs.problem.reference_cfg or runs.problem.cfg
    if cfg is None or not cfg.lora_rank:
        return []
    grads = jax.tree.map(lambda g: np.asarray(jax.device_get(g)), sharded_grads)
    ref = jax.tree.map(np.asarray, runs.reference_grads()[1])
    base_nonzero = [
        f"{m}/{n}"
        for tree in (grads, ref)
        for m, leaves in lora.base(tree).items()
        for n, g in leaves.items()
        if np.count_nonzero(g)
    ]
    adapter_max = max(float(np.abs(g).max()) for g in jax.tree.leaves(lora.adapters(grads)))
    only = check_row(
        "LoRA: only adapter gradients",
        not base_nonzero and adapter_max > 0,
        f"base gradients non-zero: {base_nonzero}"
        if base_nonzero
        else f"every base gradient exactly 0; adapters' up to {adapter_max:.3g}",
    )
    plain = lora.without_lora(cfg)
    params, tokens = runs.ref_params, jnp.asarray(runs.host_batch["inputs"])
    dtype = jnp.result_type(*{p.dtype for p in jax.tree.leaves(lora.adapters(params))})  # the proof's
    with jax.default_device(runs.device):
        logits = jax.jit(lambda c, p, t: _logits(c, p, t, dtype), static_argnums=0)
        adapted = np.asarray(logits(cfg, params, tokens))
        merged = np.asarray(logits(plain, lora.merged(cfg, params, _scale(cfg)), tokens))
        zero_b = {m: {n: (jnp.zeros_like(v) if n.endswith("_b") else v) for n, v in leaves.items()}
                  for m, leaves in params.items()}  # fmt: skip
        b0 = np.asarray(logits(cfg, zero_b, tokens))
        base = np.asarray(logits(plain, lora.base(zero_b), tokens))
    err = _rel_err(adapted, merged)
    b0_err = _rel_err(b0, base)
    return [
        only,
        *_base_kept(runs),
        check_row("LoRA: merged weights' forward = adapted forward", err <= rtol, f"max rel err {err:.2e}"),
        check_row(
            "LoRA: B = 0 gives the base's output",
            b0_err <= rtol,
            "logits bitwise equal"
            if b0_err == 0
            else f"max rel err {b0_err:.2e} (two compiled programs: the adapter's term is exactly 0, "
            "the base's matmuls may round apart)",
        ),
    ]


def _rel_err(x, ref) -> float:
    """max|x - ref| / max|ref| (normwise, as the proof's leaves); NaN where either has one."""
    return float(np.abs(x - ref).max() / max(np.abs(ref).max(), 1e-300))
