"""Optimizer and the training step, shared by the sharded run and the unsharded reference.

The step is ``grads -> clip by global norm -> AdamW``. Clipping runs on global ``jax.Array``s
under ``jit``, so the norm is of the *full* gradient whatever the sharding (XLA inserts the
reduction); a per-shard norm is the classic silent bug, planted as a control in ``meshlm verify``.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax

from meshlm.model import lora_dropout
from meshlm.model.lora import Adapters
from meshlm.model.masked import loss_weights
from meshlm.model.params import decays, flat_params, unflatten


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-3  # peak learning rate
    warmup_steps: int = 50  # linear warm-up from 0 to lr
    total_steps: int = 1000  # cosine decay ends here
    min_lr_ratio: float = 0.1  # final lr = lr * min_lr_ratio
    weight_decay: float = 0.1  # decoupled (AdamW); never on norms, biases or embeddings
    b1: float = 0.9  # Adam beta1
    b2: float = 0.95  # Adam beta2
    eps: float = 1e-8  # Adam epsilon
    clip_norm: float = 1.0  # global gradient-norm clip (0 disables)
    accum_steps: int = 1  # micro-batches per optimizer step (gradient accumulation)
    opt_dtype: str = "float32"  # AdamW's moments as stored: the master weights' dtype, or "bf16" (``adamw``)


# --opt-dtype: the AdamW moments' storage dtype by name (None: the parameters' own, float32; float64
# under --x64, where a bf16 moment stays bf16: x64 widens the arithmetic, not the storage)
OPT_DTYPES = {"float32": None, "bf16": jnp.bfloat16}


def schedule(ocfg: OptimConfig):
    warmup = min(ocfg.warmup_steps, max(ocfg.total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        0.0,
        ocfg.lr,
        warmup,
        max(ocfg.total_steps, warmup + 1),
        end_value=ocfg.lr * ocfg.min_lr_ratio,
    )


def decay_mask(params):
    """True where weight decay applies: weight matrices, not norms, biases or embeddings."""
    return unflatten({path: decays(path) for path in flat_params(params)})


def adamw(ocfg: OptimConfig, params) -> optax.GradientTransformation:
    """optax's AdamW with the run's schedule and decay mask; ``ocfg.opt_dtype`` "bf16": its first
    transformation is ``scale_by_stored_adam`` (the state's structure unchanged: checkpoints load)."""
    dtype = OPT_DTYPES[ocfg.opt_dtype]
    adam = optax.scale_by_adam(ocfg.b1, ocfg.b2, ocfg.eps)
    if dtype is not None:
        adam = scale_by_stored_adam(ocfg.b1, ocfg.b2, ocfg.eps, dtype)
    return optax.chain(  # optax.adamw's chain
        adam,
        optax.add_decayed_weights(ocfg.weight_decay, decay_mask(params)),
        optax.scale_by_learning_rate(schedule(ocfg)),
    )


def scale_by_stored_adam(b1: float, b2: float, eps: float, dtype) -> optax.GradientTransformation:
    """optax's ``scale_by_adam`` with mu and nu stored in ``dtype`` (bfloat16): every operation in the
    gradients' dtype (float32; float64 under --x64), the new moments rounded to ``dtype`` (to nearest
    even, ~2^-9 relative) and the step computed from the moments *as stored*. That order is what lets
    XLA update them in place: the step reads the new moments' buffers. (Computed from the unrounded
    moments, as optax's ``mu_dtype`` does, the step's fusion reads the old ones too and XLA copies
    them.) bfloat16 keeps 8 significant bits: nu's change per step, 1 - b2 = 5% of itself at the
    default b2 0.95, is far above its rounding (a b2 above 1 - 2^-8 would leave nu stuck)."""

    def init(params):
        zeros = lambda p: jnp.zeros(p.shape, dtype)
        return optax.ScaleByAdamState(
            count=jnp.zeros([], jnp.int32), mu=jax.tree.map(zeros, params), nu=jax.tree.map(zeros, params)
        )

    def update(grads, state, params=None):
        del params
        moment = lambda b, x, m: (b * m.astype(x.dtype) + (1 - b) * x).astype(dtype)
        mu = jax.tree.map(lambda g, m: moment(b1, g, m), grads, state.mu)
        nu = jax.tree.map(lambda g, v: moment(b2, g * g, v), grads, state.nu)
        count = optax.safe_increment(state.count)

        def step(g, m, v):  # optax's formula (eps_root 0), of the stored moments
            m_hat = m.astype(g.dtype) / (1 - b1**count).astype(g.dtype)
            v_hat = v.astype(g.dtype) / (1 - b2**count).astype(g.dtype)
            return m_hat / (jnp.sqrt(v_hat) + eps)

        return jax.tree.map(step, grads, mu, nu), optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformation(init, update)


def clip_scale(grads, max_norm: float):
    """(scale, norm): the factor that brings ``grads``' global L2 norm to at most ``max_norm`` (1 where
    it is within it, or ``max_norm`` is 0: no clip), and that norm (optax's formula). The step
    multiplies the gradients by it inside AdamW's update (``guarded_update``): no scaled copy."""
    norm = optax.tree.norm(grads)
    if not max_norm:
        return jnp.ones((), norm.dtype), norm
    return jnp.where(norm < max_norm, 1.0, max_norm / norm).astype(norm.dtype), norm


def clip_by_global_norm(grads, max_norm: float):
    """Scale ``grads`` so their global L2 norm is at most ``max_norm`` (optax's formula)."""
    scale, norm = clip_scale(grads, max_norm)
    return jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads), norm


def accumulate(grad_fn, params, batch, accum_steps: int, trained=None):
    """Mean loss and gradient over ``accum_steps`` micro-batches (batch leaves [A, B, T]). A grad_fn
    whose value is (loss, aux) (a mixture of experts' routing statistics): the aux summed over them.
    ``trained``: the part of ``params`` grad_fn's gradients are of (default: all of them)."""
    if accum_steps == 1:
        return grad_fn(params, batch)

    def body(carry, micro):
        return jax.tree.map(jnp.add, carry, grad_fn(params, micro)), None

    # the master dtype: the widest leaf's (a LoRA base stored in bf16 is narrower than its adapters)
    dtype = jnp.result_type(*{p.dtype for p in jax.tree.leaves(params)}, jnp.float32)
    value = jax.eval_shape(grad_fn, params, jax.tree.map(lambda x: x[0], batch))[0]
    loss = jnp.zeros((), dtype)
    if isinstance(value, tuple):
        loss = (loss, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), value[1]))
    like = params if trained is None else trained  # the gradients' tree: of what is trained
    (value, grads), _ = jax.lax.scan(body, (loss, jax.tree.map(jnp.zeros_like, like)), batch)
    mean = lambda x: jax.tree.map(lambda y: y / accum_steps, x)
    return ((mean(value[0]), value[1]) if isinstance(value, tuple) else mean(value)), mean(grads)


class Whole:
    """What a step trains of the parameters: all of them (``trainable``; LoRA: ``lora.Adapters``)."""

    @staticmethod
    def select(tree):
        return tree

    @staticmethod
    def put(params, trained):
        return trained


def step_count(opt_state):
    """The optimizer's step count (AdamW's ``count``: the steps it has applied), an int32 scalar."""
    return next(x for x in jax.tree.leaves(opt_state) if x.ndim == 0 and jnp.issubdtype(x.dtype, jnp.integer))


def dropout_seed(cfg, seed: int) -> int | None:
    """``make_step``'s ``dropout_seed``: ``seed`` where ``cfg`` has LoRA dropout, else None."""
    return seed if cfg.lora_dropout else None


def trainable(cfg):
    """The part of ``cfg``'s parameters a step trains (its optimizer's state is of that part only)."""
    return Adapters if cfg.lora_rank else Whole


def guarded_update(optimizer, grads, scale, opt_state, params, finite, part=Whole):
    """(params, opt_state) after ``optimizer``'s step on ``grads`` x ``scale`` (the clip's,
    ``clip_scale``) where ``finite``, else exactly as they were; either way in their own (donated)
    buffers, with no copy of the optimizer state.

    A ``lax.cond`` over the whole update, not ``where(finite, new, old)`` after it: with the select,
    the parameters' update (whose fusion recomputes the new moments from the old ones) and the select
    itself read the old moments after the new ones are written into their donated buffers, so XLA's
    copy insertion copies every moment, 2 x the trained parameters' bytes of temporaries (``copy(
    opt_state.mu[...])`` in the compiled step). In the cond's taken branch each moment is read and
    written by element-wise fusions that XLA orders or runs in place; the other branch returns its
    operands, the very buffers. The clip's scale is applied in the branch too, fused into the update:
    scaled before the cond, the gradients were a second copy (tests/test_optim_memory.py)."""

    def update(operands):
        trained, state, grads, scale = operands
        grads = jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads)
        updates, state = optimizer.update(grads, state, trained)
        return optax.apply_updates(trained, updates), state

    trained, opt_state = jax.lax.cond(
        finite, update, lambda operands: operands[:2], (part.select(params), opt_state, grads, scale)
    )
    return part.put(params, trained), opt_state


def make_step(
    grad_fn,
    optimizer: optax.GradientTransformation,
    ocfg: OptimConfig,
    clip_fn=None,
    aux_key: str = "routing",
    balance=None,
    part=Whole,
    dropout_seed: int | None = None,
):
    """(params, opt_state, batch[, healthy]) -> (params, opt_state, metrics); jit it with donated
    buffers. metrics: "loss", "grad_norm", and "ok" (whether this step updated the state); with a
    grad_fn whose value is (loss, aux), also ``aux_key``: the aux (not part of the loss or gradients;
    "routing": a mixture of experts' statistics, "dpo": DPO's reward metrics).
    ``balance``: (params, aux) -> params after AdamW, the state it does not own (a mixture of experts'
    selection bias, ``model.routers.balance_update``; it needs the aux). ``part`` (``trainable``): what
    is trained, what ``optimizer`` was made for; the rest stays. ``dropout_seed`` (``--lora-dropout``):
    the batch gains each token's dropout seed, of this seed and the optimizer's step count (a resumed
    run draws the masks it would have drawn; ``model.lora_dropout``); None: no dropout."""
    clip_fn = clip_fn or (lambda g: clip_scale(g, ocfg.clip_norm))

    def part_grad(params, batch):  # LoRA: the frozen base's gradients are zero, never used
        value, grads = grad_fn(params, batch)
        return value, part.select(grads)

    def step(params, opt_state, batch, healthy=None):
        batch = loss_weights(batch)  # the SFT mask, normalized over the whole step (every micro-batch)
        if dropout_seed is not None:
            batch = lora_dropout.with_seeds(batch, dropout_seed, step_count(opt_state))
        loss, grads = accumulate(part_grad, params, batch, ocfg.accum_steps, part.select(params))
        loss, aux = loss if isinstance(loss, tuple) else (loss, None)
        if isinstance(aux, dict) and "mtp" in aux:  # MTP's depth losses (and routing): ``loss_fn``'s
            aux = {**aux, "mtp": aux["mtp"] / ocfg.accum_steps}  # summed over micro-batches, as the aux
        elif aux is not None:
            aux = {aux_key: aux}
        scale, grad_norm = clip_fn(grads)  # the clip's scale, applied in the update
        # A non-finite loss or gradient leaves the state untouched, so the caller can stop and save
        # the last good state (the inputs are donated: without this they would be gone).
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        if healthy is not None:
            # ``healthy``: the previous step's metrics["ok"]. A loop that reads metrics a step late
            # passes it, so every step after a non-finite one keeps the state too (sticky).
            finite = finite & healthy
        params, opt_state = guarded_update(optimizer, grads, scale, opt_state, params, finite, part)
        if balance is not None:  # from the routing of the step's whole global batch; kept as it was too
            moved = balance(params, aux[aux_key])  # on a non-finite step (the leaves it moves: the biases)
            params = jax.tree.map(lambda n, o: o if n is o else jnp.where(finite, n, o), moved, params)
        metrics = {"loss": loss, "grad_norm": grad_norm, "ok": finite}
        return params, opt_state, metrics if aux is None else {**metrics, **aux}

    return step
