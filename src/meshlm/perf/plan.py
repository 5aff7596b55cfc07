"""The memory planner: one device's memory for a training run, compiled ahead of time and estimated.

``measure`` builds the *real* train step (``train.step.sharded_step``) from abstract shapes:
parameters, AdamW state and the batch are ``jax.ShapeDtypeStruct``s carrying their NamedShardings,
and ``jax.jit(step).lower(...).compile()`` runs XLA's partitioner, scheduler and buffer assignment
without allocating anything of the model. ``compiled.memory_analysis()`` then gives one device's
argument, output, alias and temporary bytes; the peak is argument + output + temp - alias (outputs
written into donated parameter/optimizer buffers are not counted twice), as in ``meshlm bench``.

Compiled on host CPU devices, the temporaries are XLA *CPU*'s plan: an accelerator's compiler fuses
and schedules differently, and its runtime adds its own overheads (context, allocator), so on CPU
the figure is an estimate of an accelerator's. Next to it, ``analytic`` estimates the same from
shapes: parameters and AdamW moments from the shardings, gradients like the parameters (twice with
gradient accumulation: the running sum), the old AdamW moments copied once (``MOMENT_COPIES``), with
FSDP one layer's all-gathered weights, and activations from Korthikanti et al. 2022, a mixture of
experts' dispatch buffers in place of its MLP (``perf.activations``).

Why the old moments are copied: the step writes the new moments into the donated moment buffers
(outputs aliased to inputs), and the non-finite guard ``where(finite, new, old)`` and the parameters'
update (whose fusion recomputes the new moments from the old) still read the old ones after that: XLA's
copy insertion copies both moments of every parameter (``copy(opt_state.mu[...])``,
``copy(opt_state.nu[...])`` in the compiled HLO), 2 x the parameters' bytes among the temporaries. It
was most of the gap on mixtral-8x7b (8x8 + EP8, fsdp + sp): analytic 13.66 GiB against 21.62 GiB
compiled before it and the MoE dispatch buffers were counted.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from meshlm.errors import ConfigError
from meshlm.model.config import ModelConfig
from meshlm.parallel.layout import Layout
from meshlm.parallel.placement import bytes_per_device, total_bytes
from meshlm.perf.activations import activation_bytes
from meshlm.perf.plan_settings import PlanSettings

PARAM_DTYPE = np.float32  # master weights (and so gradients and AdamW moments) are float32
ADAM_MOMENTS = 2
MOMENT_COPIES = ADAM_MOMENTS  # the old moments, copied by XLA for the update (module docstring)


def abstract_step(cfg: ModelConfig, layout: Layout, settings: PlanSettings):
    """(jitted step, params, opt_state, batch): the train step on ``layout``'s mesh with the
    settings' memory options, and ShapeDtypeStruct arguments."""
    from meshlm.parallel.placement import batch_sharding
    from meshlm.train.optim import OptimConfig, trainable
    from meshlm.train.step import COMPUTE_DTYPES, abstract_opt_state, sharded_step, step_model

    cfg = step_model(cfg, remat=settings.remat, unroll=cfg.unroll, fsdp=settings.fsdp)
    layout = settings.on(layout)
    specs, params = planned_params(cfg, layout, settings)
    ocfg = OptimConfig(accum_steps=settings.accum_steps)
    dtype = COMPUTE_DTYPES[settings.compute_dtype]
    step, opt = sharded_step(cfg, ocfg, layout, specs, params, dtype)
    part = trainable(cfg)  # LoRA: AdamW state for the adapters alone
    opt_state = abstract_opt_state(opt, part.select(params), part.select(specs), layout.mesh)
    micro = settings.batch_size // settings.accum_steps
    shape = (
        (micro, settings.seq_len)
        if settings.accum_steps == 1
        else (settings.accum_steps, micro, settings.seq_len)
    )
    rows = batch_sharding(layout, settings.accum_steps)
    batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=rows) for k in ("inputs", "targets")}
    return step, params, opt_state, batch


def measure(cfg: ModelConfig, layout: Layout, settings: PlanSettings) -> dict:
    """Compile the step ahead of time; one device's bytes by layout and by XLA's memory analysis."""
    from meshlm.perf.bench import compiled_memory

    step, params, opt_state, batch = abstract_step(cfg, layout, settings)
    start = time.perf_counter()
    compiled = step.lower(params, opt_state, batch).compile()
    seconds = time.perf_counter() - start
    memory = compiled_memory(compiled)
    if memory is None:
        raise ConfigError(f"XLA's {jax.default_backend()} compiler reports no memory analysis; plan on CPU")
    return {
        "params": bytes_per_device(params),
        "opt_state": bytes_per_device(opt_state),
        **memory,
        "compile_s": seconds,
    }


def planned_params(cfg: ModelConfig, layout: Layout, settings: PlanSettings):
    """(specs, params): the rules table's specs on ``layout`` with the settings' memory options, and
    float32 ShapeDtypeStructs with their shardings (a LoRA base stored in bf16: bfloat16; uneven pp
    stages: the padded stack the devices hold, ``sharding.stage_slots``)."""
    from meshlm.model.transformer import param_shapes
    from meshlm.sharding.rules import model_specs, shardings
    from meshlm.sharding.stage_slots import slots_of
    from meshlm.train.lora import stored_base

    layout = settings.on(layout)
    shapes = param_shapes(cfg)
    specs = model_specs(cfg, shapes, layout)
    slots = slots_of(cfg, layout)
    shapes = shapes if slots is None else slots.pad(shapes)
    params = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, PARAM_DTYPE, sharding=sh),
        shapes,
        shardings(specs, layout.mesh),
    )
    return specs, stored_base(params, settings.base_dtype)  # LoRA: a bf16 base (--base-dtype)


def state_bytes(cfg: ModelConfig, layout: Layout, settings: PlanSettings) -> dict:
    """Parameter bytes, unsharded and on one device, from the shapes and the rules table's specs; and
    of those trained (``optim.trainable``: with LoRA the adapters, whose gradients and moments exist)."""
    from meshlm.sharding.stage_slots import slots_of
    from meshlm.train.optim import trainable

    _, params = planned_params(cfg, layout, settings)
    trained = trainable(cfg).select(params)
    slots = slots_of(cfg, settings.on(layout))  # the totals count the real layers, not uneven stages' padding
    real = (lambda tree: tree) if slots is None else slots.unpad
    return {
        "params_total": total_bytes(real(params)),
        "params_per_device": bytes_per_device(params),
        "trained": bytes_per_device(trained),
        "trained_total": total_bytes(real(trained)),
    }


def analytic(cfg: ModelConfig, layout: Layout, settings: PlanSettings) -> dict:
    """One device's bytes estimated from shapes: the state, gradients and activations (see above)."""
    dp, mp = layout.dp, layout.mp
    state = state_bytes(cfg, layout, settings)
    params, trained = state["params_per_device"], state["trained"]  # LoRA: trained = the adapters
    act_bytes = 2 if settings.compute_dtype == "bfloat16" else 4
    acts = activation_bytes(
        cfg,
        seq=settings.seq_len,
        micro_batch=settings.micro_batch(dp),
        mp=mp,
        sp=settings.sp,
        remat=settings.remat,
        act_bytes=act_bytes,
        ep=layout.ep if layout.experts_split else 1,
    )
    gradients = trained * (2 if settings.accum_steps > 1 else 1)  # + the accumulator's running sum
    opt_state = ADAM_MOMENTS * trained
    moment_copies = MOMENT_COPIES * trained
    gathered = 0.0
    if settings.fsdp:  # ZeRO-3 gathers one layer's weights at a time: what FSDP took off, per layer
        plain = state_bytes(cfg, layout, dataclasses.replace(settings, fsdp=False))["params_per_device"]
        gathered = (plain - params) / cfg.n_layers
    temporaries = gradients + moment_copies + acts["total"] + gathered
    return {
        "params": params,
        "opt_state": opt_state,
        "gradients": gradients,
        "moment_copies": moment_copies,
        "gathered": gathered,
        "activations": acts,
        "temp": temporaries,
        "peak": params + opt_state + temporaries,
    }
