"""The two runs the proof compares: the sharded program on the mesh and the reference on one device.

Both start from the same parameters (created sharded, then copied whole to one device for the
reference) and see the same host batches. The reference is built from ``Parallel()`` (no mesh axis)
and run under plain ``jit`` on one device; ``independence`` checks that it really is.
"""

from __future__ import annotations

from functools import partial

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from meshlm.model.lora_dropout import with_seeds
from meshlm.model.routers import balance_update, balances
from meshlm.model.transformer import loss_fn
from meshlm.parallel.context import Parallel
from meshlm.parallel.layout import Layout
from meshlm.parallel.placement import batch_sharding, put_global, to_host
from meshlm.proof.controls import per_shard_clip
from meshlm.proof.problem import Problem
from meshlm.proof.reference import CheckedProgram, reference_optimizer, reference_step
from meshlm.proof.sft import proof_batch
from meshlm.sharding.rules import shardings
from meshlm.sharding.spmd import reference_value_and_grad
from meshlm.sharding.stage_slots import slot_balance
from meshlm.sharding.strategy import strategy
from meshlm.train.optim import OptimConfig, Whole, adamw, dropout_seed, make_step, trainable
from meshlm.train.step import init_opt_state


def put_batch(batch, layout: Layout, accum: bool):
    """Host batch -> global arrays (each process supplies the rows of its own devices)."""
    sharding = batch_sharding(layout, 2 if accum else 1)
    return {k: put_global(v, sharding) for k, v in batch.items()}


class Runs:
    """The reference and sharded runs of one Problem on one layout, sharing inputs and parameters."""

    def __init__(self, problem: Problem, layout: Layout, dtype, seed: int):
        self.problem, self.layout, self.mesh = problem, layout, layout.mesh
        mesh = self.mesh
        self.device = jax.local_devices()[0]  # the reference runs on one device of this process
        self.params, self.specs = _init(problem, mesh, dtype, seed)
        if problem.load_params is not None:  # e.g. a checkpoint: same specs (FSDP too), on this layout
            self.params = jax.tree.map(lambda p: p.astype(dtype), problem.load_params(layout))
        elif problem.prepare_params is not None:
            self.params = problem.prepare_params(self.params)
            if problem.slots is not None:  # uneven pp stages: a planted bias must not fill the padding
                redo = lambda p: problem.slots.pad(problem.slots.unpad(p))
                self.params = jax.jit(redo, out_shardings=shardings(self.specs, mesh))(self.params)
        host = problem.to_reference(jax.tree.map(to_host, self.params))
        self.ref_params = jax.device_put(host, self.device)
        self.ref_loss = problem.reference_loss or problem.build_loss
        self.ref_split = reference_microbatches(problem.cfg, layout)  # None, or the pipeline's (S, M)
        self.host_batch = proof_batch(problem.batch, problem.cfg)  # the SFT mask normalized (``proof.sft``)
        self.batch = put_batch(self.host_batch, layout, False)  # the global batch on the mesh
        self.checked: list[CheckedProgram] = []  # the programs that computed the reference's values
        # A control's planted program as the inertness check traced it (``Traced``, its parameters), by
        # the control's name: its run lowers that trace instead of tracing again (under pp a trace of
        # the whole pipeline is seconds). Shared by the copies ``proof.pipeline_verify`` makes.
        self.traced: dict[str, tuple] = {}

    def value_and_grad(self, build_loss, par_cls=Parallel, pipe_cls=None, cfg=None, routing=False):
        """The sharded fn(params, batch) -> (loss, grads); with pp the problem's model (or ``cfg``, a
        control's changed one: the pipeline runs the model's pieces, not ``build_loss``) through the
        pipeline (``pipe_cls``: a control's engine), NaN in every bubble: it must never reach a result.
        ``routing``: ``build_loss`` returns (loss, routing statistics), and so does the function."""
        return strategy(self.layout).value_and_grad(
            cfg or self.problem.cfg,
            self.layout,
            self.specs,
            build_loss=build_loss,
            par_cls=par_cls,
            pipe_cls=pipe_cls,
            fill=float("nan"),
            routing=routing,
        )

    def sharded_fn(self, build_loss, par_cls=Parallel, pipe_cls=None, cfg=None):
        return jax.jit(self.value_and_grad(build_loss, par_cls, pipe_cls, cfg))

    def run_traced(self, name: str, fn, params):
        """``fn(params, batch)``, lowering the program traced as ``name`` where the inertness check kept
        it (``traced``; once: the entry goes), else by ``fn`` itself."""
        traced = self.traced.pop(name, None)
        if traced is None:
            return fn(params, self.batch)
        program, params = traced
        return program.lower().compile()(params, self.batch)

    def grads(self, build_loss, par_cls=Parallel, params=None):
        """The sharded loss and gradients of ``build_loss`` (at ``params``, default the proof's)."""
        return self.sharded_fn(build_loss, par_cls)(self.params if params is None else params, self.batch)

    def proven_grads(self):
        """The sharded loss and gradients of the problem itself, compiled once: the same executable
        gives the values and, for the independence check, its HLO (``sharded_hlo``)."""
        compiled = self.sharded_fn(self.problem.build_loss).lower(self.params, self.batch).compile()
        self.sharded_hlo = compiled.as_text()
        return compiled(self.params, self.batch)

    def reference_program(self):
        """(function, arguments) of the reference: the unsharded loss and gradients on one device."""
        fn = reference_value_and_grad(self.ref_loss, microbatches=self.ref_split)
        return fn, (self.ref_params, jax.device_put(self.host_batch, self.device))

    def reference_grads(self):
        """The unsharded loss and gradients (computed once: every control compares against them), by
        the checked program itself (``checked``: what the independence check reads)."""
        if not hasattr(self, "_ref_grads"):
            fn, args = self.reference_program()
            program = self._checked(CheckedProgram("loss and gradients", fn, *args))
            self._ref_grads = self.problem.from_reference(program(*args))
        return self._ref_grads

    def _checked(self, program: CheckedProgram) -> CheckedProgram:
        self.checked.append(program)
        return program

    def reference_train(self, ocfg: OptimConfig, batches) -> list:
        """The unsharded (params, opt_state, metrics) after each step, computed once per config by a
        checked program (``_reference_states``)."""
        key = (ocfg, len(batches))
        cache = self.__dict__.setdefault("_ref_train", {})
        if key not in cache:
            cache[key] = _reference_states(self, ocfg, batches)
        return cache[key]

    def train_step(self, ocfg: OptimConfig, clip_fault: bool = False, par_cls=Parallel, seed: int = 0):
        """The sharded training step (jitted, not yet traced) and its initial (params, opt_state); a
        mixture of experts that balances by a selection bias moves it after AdamW (``make_step``), from
        the routing statistics its loss then returns. ``par_cls``: a control's parallel context. As
        training's (``train.step.sharded_step``): AdamW of what the run trains (LoRA: the adapters);
        with ``--lora-dropout`` each token's dropout seed of ``seed`` and the step's count."""
        part, cfg = _part(self.problem), self.problem.cfg
        opt = adamw(ocfg, part.select(self.params))
        balance = None if cfg is None else slot_balance(balance_update(cfg), self.problem.slots)
        build = self.problem.build_loss if balance is None else (lambda par: loss_fn(cfg, par, True))
        grad = self.value_and_grad(build, par_cls, routing=balance is not None)
        specs = part.select(self.specs)
        clip = per_shard_clip(self.mesh, specs, ocfg.clip_norm) if clip_fault else None
        drop = None if cfg is None else dropout_seed(cfg, seed)
        step = make_step(grad, opt, ocfg, clip, balance=balance, part=part, dropout_seed=drop)
        # the state laid out as the step returns it (training's ``init_opt_state``): step 2 then runs
        # step 1's program, not a second compilation for the optimizer counters' placement
        return jax.jit(step), (self.params, initial_state(self, opt, part.select(self.params), specs))

    def train(self, ocfg: OptimConfig, batches, clip_fault: bool = False, par_cls=Parallel, seed: int = 0):
        """Yield ((params, opt_state, metrics) sharded, the same unsharded) after each step (``seed``:
        ``step_batches``')."""
        step, state = self.train_step(ocfg, clip_fault, par_cls, seed)
        accum = ocfg.accum_steps > 1
        for b, ref in zip(batches, self.reference_train(ocfg, batches), strict=True):
            *state, metrics = step(*state, put_batch(b, self.layout, accum))
            yield (*state, metrics), ref


def _reference_states(runs: Runs, ocfg: OptimConfig, batches) -> list:
    """The plain step of ``proof.reference`` (optax's clip and AdamW) over ``batches``, as one checked
    program, training what the run trains (``trainable``: LoRA's adapters; the frozen base kept)."""
    part = _part(runs.problem)
    opt = reference_optimizer(ocfg, part.select(runs.ref_params))
    # committed to the reference's device, as the step's outputs are: one compilation for every step
    opt_state = jax.device_put(initial_state(runs, opt, part.select(runs.ref_params)), runs.device)
    state, out = (runs.ref_params, opt_state), []
    step = _reference_train_step(runs.problem, runs.ref_loss, ocfg, opt, part, runs.ref_split)
    first = jax.device_put(batches[0], runs.device)
    program = runs._checked(CheckedProgram("train step", step, *state, first))
    for b in batches:
        *state, metrics = program(*state, jax.device_put(b, runs.device))
        out.append(runs.problem.from_reference((*state, metrics)))
    return out


def initial_state(runs: Runs, opt, params, specs=None):
    """``opt``'s initial state at ``params``: with ``specs`` laid out as the sharded step returns it
    (training's ``init_opt_state``), else as ``jit(opt.init)`` gives it. Made once per proof for each
    init program at the parameters' placement (its jaxpr and constants: a learning rate or a clip
    changes the step, not the state, which no step of the proof donates): the controls' steps start
    from the proof's state, the reference's from the reference's."""
    closed = jax.make_jaxpr(opt.init)(params)
    placed = tuple(x.sharding for x in jax.tree.leaves(params))
    key = (specs is None, placed, str(closed), *(np.asarray(c).tobytes() for c in closed.consts))
    made = runs.__dict__.setdefault("_opt_states", {})
    if key not in made:
        init = (
            jax.jit(opt.init) if specs is None else partial(init_opt_state, opt, specs=specs, mesh=runs.mesh)
        )
        made[key] = init(params)
    return made[key]


def _part(problem: Problem):
    """What a step trains (``train.optim.trainable``): every parameter, or LoRA's adapters."""
    return Whole if problem.cfg is None else trainable(problem.cfg)


def reference_grad_norm(runs: Runs) -> float:
    """The reference gradients' global L2 norm (the proof's clip is a tenth of it: ``default_optim``),
    on the host: an eager norm on the device compiles a few small programs per leaf shape."""
    leaves = jax.tree.leaves(jax.tree.map(to_host, runs.reference_grads()[1]))
    return float(np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64))) for x in leaves)))


def _init(problem: Problem, mesh, dtype, seed: int):
    """The proof's parameters and their specs (None and the specs where ``problem.load_params`` gives
    the parameters). Created by the unsharded init program on this process's first device, then laid
    out by the specs: that program is the same on every mesh of a model (a compilation-cache hit after
    the first mesh; a sharded init compiles one per mesh), and the values are those any mesh's init
    gives (JAX's partitionable threefry; ``rules.init_sharded``). The example batch is one row when
    every leaf has the rows first (the parameters do not depend on the batch)."""
    init = hk.transform(problem.build_loss(Parallel())).init
    if problem.load_params is not None:  # a checkpoint's parameters replace them: no init runs, and no
        # program compiles for it (the init's compile was the proof's largest, for values thrown away)
        return None, problem.specs_fn(
            jax.eval_shape(lambda b: init(jax.random.PRNGKey(seed), b), problem.batch)
        )
    example = jax.tree.map(jnp.asarray, problem.batch)
    rows = {np.shape(v)[0] if np.ndim(v) else None for v in jax.tree.leaves(example)}
    if len(rows) == 1 and None not in rows:
        example = jax.tree.map(lambda v: v[:1], example)
    key = jax.random.PRNGKey(seed)
    specs = problem.specs_fn(jax.eval_shape(init, key, example))
    traced = jax.jit(init)  # the program eval_shape traced: the Haiku forward is traced once, not twice
    host = jax.jit(lambda k, b: jax.tree.map(lambda p: p.astype(dtype), traced(k, b)))(key, example)
    if problem.slots is not None:  # uneven pp stages: the body's stack padded (``sharding.stage_slots``)
        host = problem.slots.pad(jax.tree.map(np.asarray, host))
    placed = jax.tree.map(lambda x, s: put_global(np.asarray(x), s), host, shardings(specs, mesh))
    return placed, specs


def _reference_train_step(problem: Problem, ref_loss, ocfg: OptimConfig, opt, part, split=None):
    """The unsharded training step: a mixture of experts that balances by a selection bias has its
    loss return the routing, from which the bias moves after AdamW. ``part``: what it trains;
    ``split``: each (accumulation) micro-batch's gradient the mean over the pipeline's (``Runs``)."""
    cfg = problem.reference_cfg or problem.cfg
    if cfg is not None and balances(cfg):
        grad = reference_value_and_grad(lambda par: loss_fn(cfg, par, True), has_aux=True, microbatches=split)
        return reference_step(grad, ocfg, opt, bias_rate=cfg.moe_bias_rate, part=part)
    return reference_step(reference_value_and_grad(ref_loss, microbatches=split), ocfg, opt, part=part)


def reference_microbatches(cfg, layout: Layout):
    """(S row shards, M micro-batches) where the step's values depend on the pipeline's micro-batches
    (``--quant int8`` under pp: each micro-batch's weight-gradient scales its own), so the reference is
    the mean over the same micro-batches (``sharding.spmd.mean_of_microbatches``); else None."""
    if cfg is None or cfg.quant == "none" or layout.pp == 1:
        return None
    return layout.dp, layout.pipeline_microbatches


def step_batches(problem: Problem, steps: int, accum: int, seed: int) -> list[dict]:
    """Fresh batches for the proof's training steps ([A, B, T] with accumulation): random ids, or
    ``problem.batch_fn``'s."""
    from meshlm.proof.problem import random_batch

    b, t = problem.batch["inputs"].shape
    vocab = int(problem.batch["inputs"].max()) + 1 if problem.cfg is None else problem.cfg.vocab_size
    shape = (accum, b, t) if accum > 1 else (b, t)
    make = problem.batch_fn or (lambda shape, s: random_batch(vocab, shape, s))
    batches = [make(shape, seed + 1000 + k) for k in range(steps)]
    if problem.cfg is not None and problem.cfg.lora_dropout:  # each step's own dropout seeds
        batches = [
            {n: np.asarray(v) for n, v in with_seeds(b, seed, k).items()} for k, b in enumerate(batches)
        ]
    return batches


def default_optim(steps: int, ref_grad_norm: float, opt_dtype: str = "float32") -> OptimConfig:
    """The proof's optimizer: warm-up and decay inside K steps, 2 micro-batches, weight decay, and a
    clip at a tenth of the initial gradient norm, so that clipping (and its norm) is exercised on every
    step (an inactive clip would hide a wrong norm; batches of the steps can have smaller norms than
    the first); its moments stored in ``opt_dtype`` (the problem's, ``--opt-dtype``)."""
    return OptimConfig(
        lr=1e-2,
        warmup_steps=1,
        total_steps=max(steps, 2),
        weight_decay=0.1,
        clip_norm=0.1 * ref_grad_norm,
        accum_steps=2,
        opt_dtype=opt_dtype,
    )
