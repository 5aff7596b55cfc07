"""``meshlm verify --objective dpo --steps K``: K of training's DPO steps against the unsharded ones.

The sharded step is training's own (``train.step.sharded_step`` with DPO: the sharded DPO gradient,
the clip, AdamW of what the run trains -- LoRA: the adapters alone); the reference step is the proof's
plain one (``proof.reference.reference_step``: a Python loop over the micro-batches, optax's clip and
AdamW) on DPO's formula differentiated by JAX (``proof.dpo.reference_program``). After each step every
parameter and optimizer-state leaf is compared as pretraining's proof compares them, AdamW's division
of the moments' measured difference excused element by element (``proof.adam_drift``), and the step's
loss.

Each step: fresh pairs, dealt into ``default_optim``'s 2 accumulation micro-batches of whole pairs as
training deals them (``data.pairs.PairBatcher``: micro-batch a the rows [a B / A, (a + 1) B / A)); the
reference log-probs computed by training's sharded seam (``train.dpo.reference_logps``) from the frozen
reference weights, the unsharded step computing its own from the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from meshlm.model import preference
from meshlm.parallel.placement import batch_sharding, put_global, to_host
from meshlm.proof.adam_drift import AdamDrift
from meshlm.proof.reference import reference_optimizer, reference_step
from meshlm.proof.report import compare_into, leaf_label
from meshlm.proof.runs import default_optim, put_batch
from meshlm.train import dpo
from meshlm.train.optim import trainable
from meshlm.train.step import init_opt_state, sharded_step


@dataclass(frozen=True)
class DPOSteps:
    """What the steps run: the model, its problem (the reference's shapes), layout and specs, DPO's
    beta and loss, and the reference program (fn(params, reference params, batch) -> (values, grads))."""

    cfg: object
    problem: object
    layout: object
    specs: object
    beta: float
    loss: str
    reference: object


def _micro(batch: dict, accum: int) -> dict:
    """[B, ...] -> [A, B / A, ...]: micro-batch a the rows [a B / A, (a + 1) B / A) (whole pairs)."""
    return {k: np.asarray(v).reshape(accum, -1, *np.shape(v)[1:]) for k, v in batch.items()}


def _grad_norm(grads) -> float:
    return float(np.sqrt(sum(np.sum(np.square(np.asarray(g, np.float64))) for g in jax.tree.leaves(grads))))


def dpo_steps(run: DPOSteps, results: dict, loss_check, params, ref_params, batches, grads, rtol, atol):
    """Fold K steps (one per host batch of ``batches``, [B, T]) into ``results`` and ``loss_check``;
    ``grads``: the reference's first gradients (the clip is a tenth of their norm, so it acts).
    Returns the sharded parameters after the last step."""
    ocfg = default_optim(len(batches), _grad_norm(grads), run.problem.opt_dtype)
    accum, part = ocfg.accum_steps, trainable(run.cfg)
    step, opt = sharded_step(run.cfg, ocfg, run.layout, run.specs, params, dpo=(run.beta, run.loss))
    # the step donates (a copy); the state laid out as the step returns it: one compilation for K steps
    opt_state = init_opt_state(opt, part.select(params), part.select(run.specs), run.layout.mesh)
    state = (jax.tree.map(jnp.copy, params), opt_state)
    device = jax.local_devices()[0]
    one = lambda tree: jax.device_put(run.problem.to_reference(jax.tree.map(to_host, tree)), device)
    frozen, policy = one(ref_params), one(params)
    ref_opt = reference_optimizer(ocfg, part.select(policy))

    def ref_grad(p, micro):
        values, g = run.reference(p, frozen, micro)
        return values["loss"], g

    ref_step = jax.jit(reference_step(ref_grad, ocfg, ref_opt, part=part))
    ref_state = (policy, jax.device_put(jax.jit(ref_opt.init)(part.select(policy)), device))
    logps = dpo.per_token_logps(run.cfg.replace(z_loss=0.0), run.layout, run.specs)
    seam = jax.jit(lambda r, b: dpo.reference_logps(logps, r)(b))  # training's: from the frozen weights
    drift = AdamDrift(ocfg, leaf_label)
    for host in batches:
        tokens = {k: put_global(v, batch_sharding(run.layout, 1)) for k, v in host.items()}
        ref_logps = np.asarray(to_host(seam(ref_params, tokens)))
        sharded = put_batch(_micro({**host, preference.REF_LOGPS: ref_logps}, accum), run.layout, True)
        *state, ms = step(*state, sharded)
        *ref_state, mr = ref_step(*ref_state, jax.device_put(_micro(host, accum), device))
        pr, sr = run.problem.from_reference(jax.tree.map(np.asarray, tuple(ref_state)))
        compare_into(results, state[0], pr, rtol, atol, drift.step(state[1], sr))
        compare_into(results, state[1], sr, rtol, atol)
        loss_check.update(to_host(ms["loss"]), np.asarray(mr["loss"]), rtol, atol)
    return state[0]
