"""The reference: the plainest program, and the very program whose jaxpr the independence check reads.

``CheckedProgram`` traces a reference function once and computes its values *from that jaxpr*
(``jaxpr_as_fun`` under ``jit``, on one device): the program the independence check inspects is,
by construction, the one that produced the values verify compares. A refactor cannot compute the
values one way and show the check another.

The reference training step shares as little with the sharded one as the comparison allows:

* the loss is the model without recomputation (remat "none") with every layer unrolled, whatever
  the sharded side's remat policy and layer loop (``model_problem``'s ``reference_loss``);
* gradient accumulation is a Python loop over the micro-batches, not ``train.optim.accumulate``'s
  scan;
* the clip is ``optax.clip_by_global_norm`` and the optimizer ``optax.adamw``, called here, not
  ``train.optim.clip_by_global_norm`` / ``make_step``. What both share, on purpose: the learning-rate
  schedule (``train.optim.schedule``) and the weight-decay mask (``train.optim.decay_mask``), the
  settings of the run being proven; ``docs`` say why each is trusted.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.extend.core import jaxpr_as_fun

from meshlm.model.params import is_mtp
from meshlm.train.optim import OptimConfig, Whole, adamw


class CheckedProgram:
    """``fn`` traced once at ``example`` arguments; calling it evaluates that jaxpr under ``jit``."""

    def __init__(self, name: str, fn, *example):
        self.name = name
        self.closed, out_shapes = jax.make_jaxpr(fn, return_shape=True)(*example)
        self._out_tree = jax.tree.structure(out_shapes)
        self._run = jax.jit(jaxpr_as_fun(self.closed))

    @property
    def jaxpr(self):
        return self.closed.jaxpr

    def __call__(self, *args):
        return jax.tree.unflatten(self._out_tree, self._run(*jax.tree.leaves(args)))


def reference_optimizer(ocfg: OptimConfig, params) -> optax.GradientTransformation:
    """AdamW from optax itself (``train.optim.adamw`` is optax.adamw's chain of optax's own pieces, no
    code of ours), with the proven run's schedule and weight-decay mask. With ``--opt-dtype bf16`` its
    first piece is ``train.optim.scale_by_stored_adam`` (ours, element-wise: shared, as the schedule
    is; the sharded and unsharded moments then round to bfloat16 from values equal to ~1e-16)."""
    return adamw(ocfg, params)


def reference_step(
    grad_fn, ocfg: OptimConfig, optimizer: optax.GradientTransformation, bias_rate=None, part=Whole
):
    """(params, opt_state, batch) -> (params, opt_state, {"loss"}): mean over micro-batches (a Python
    loop), ``optax.clip_by_global_norm``, then ``optimizer``. Batch leaves are [A, B, T] with
    accumulation (A = ``ocfg.accum_steps``), else [B, T]. ``bias_rate`` (a mixture of experts that
    balances by a selection bias; ``grad_fn``'s value is then (loss, routing statistics [L, 2E + 3])):
    after AdamW each layer's bias moves by rate x sign(mean load - load), the loads summed over the
    micro-batches (``_balanced``: written here, not ``model.routers``'). ``part`` (``train.optim.trainable``,
    the run's setting): what is clipped and moved (LoRA: the adapters; the frozen base is kept)."""
    clip = optax.clip_by_global_norm(ocfg.clip_norm) if ocfg.clip_norm else optax.identity()
    accum = ocfg.accum_steps

    def step(params, opt_state, batch):
        if "loss_mask" in batch:  # the SFT loss over the whole step: its definition, written out here
            mask = batch["loss_mask"].astype(jnp.asarray(1.0).dtype)
            batch = {k: v for k, v in batch.items() if k != "loss_mask"}  # (LoRA dropout's seeds kept)
            batch["weights"] = mask * mask.size / jnp.maximum(mask.sum(), 1)
        micro = [batch] if accum == 1 else [jax.tree.map(lambda x, a=a: x[a], batch) for a in range(accum)]
        losses, grads = zip(*(grad_fn(params, m) for m in micro), strict=True)
        if bias_rate is not None:
            losses, stats = zip(*losses, strict=True)
        loss = sum(losses) / accum
        grads = part.select(jax.tree.map(lambda *g: sum(g) / accum, *grads))
        grads, _ = clip.update(grads, clip.init(grads))
        updates, opt_state = optimizer.update(grads, opt_state, part.select(params))
        params = part.put(params, optax.apply_updates(part.select(params), updates))
        if bias_rate is not None:
            params = _balanced(params, sum(stats), bias_rate)
        return params, opt_state, {"loss": jnp.asarray(loss)}

    return step


def _balanced(params, stats, rate: float):
    """Every ``.../moe/router/balance_bias`` [L, E] plus rate x sign(its layer's mean load - the
    expert's load), the loads the first E columns of ``stats`` [L, 2E + 3] (DeepSeek-V3's update)."""
    out = {}
    for module, leaves in params.items():
        out[module] = dict(leaves)
        if module.endswith("moe/router") and "balance_bias" in leaves and not is_mtp(module):  # ``model.mtp``
            bias = leaves["balance_bias"]
            load = stats[:, : bias.shape[-1]]
            out[module]["balance_bias"] = bias + (
                rate * jnp.sign(load.mean(-1, keepdims=True) - load)
            ).astype(bias.dtype)
    return out
