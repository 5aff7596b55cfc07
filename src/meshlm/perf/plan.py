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
gradient accumulation: the running sum), with FSDP one layer's all-gathered weights, and activations
from Korthikanti et al. 2022, a mixture of experts' dispatch buffers in place of its MLP
(``perf.activations``).

No copy of the optimizer state: AdamW updates its moments in place (``train.optim.guarded_update``).
Before that, the step's non-finite guard ``where(finite, new, old)`` and the parameters' update (whose
fusion recomputes the new moments from the old) read the old moments after the new ones were written
into the donated buffers, and XLA's copy insertion copied both moments of every parameter (``copy(
opt_state.mu[...])`` in the compiled HLO), 2 x the parameters' bytes among the temporaries
(``MOMENT_COPIES``, now 0; tests/test_optim_memory.py holds the step to none).
"""

from __future__ import annotations

import dataclasses
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from meshlm.errors import ConfigError, is_out_of_memory
from meshlm.model.config import ModelConfig
from meshlm.parallel.layout import Layout
from meshlm.parallel.placement import bytes_per_device, total_bytes
from meshlm.perf.activations import activation_bytes
from meshlm.perf.plan_settings import PlanSettings

PARAM_DTYPE = np.float32  # master weights (and so gradients and AdamW moments) are float32
ADAM_MOMENTS = 2
MOMENT_SCALE = {"float32": 1.0, "bf16": 0.5}  # --opt-dtype: a moment's bytes over a float32 parameter's
MOMENT_COPIES = 0  # copies of the old moments XLA makes for the update: none (module docstring)


def abstract_step(cfg: ModelConfig, layout: Layout, settings: PlanSettings):
    """(jitted step, params, opt_state, batch): the train step on ``layout``'s mesh with the
    settings' memory options, and ShapeDtypeStruct arguments."""
    from meshlm.parallel.placement import batch_sharding
    from meshlm.train.optim import OptimConfig, trainable
    from meshlm.train.step import COMPUTE_DTYPES, abstract_opt_state, sharded_step, step_model

    cfg = step_model(cfg, remat=settings.remat, unroll=cfg.unroll, fsdp=settings.fsdp)
    layout = settings.on(layout)
    specs, params = planned_params(cfg, layout, settings)
    ocfg = OptimConfig(accum_steps=settings.accum_steps, opt_dtype=settings.opt_dtype)
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


def measure(cfg: ModelConfig, layout: Layout, settings: PlanSettings, platform: str | None = None) -> dict:
    """Compile the step ahead of time; one device's bytes by layout and by XLA's memory analysis.
    ``platform``: the one compiled for (``plan_target``: "tpu" for a chip's compile-only devices on
    ``layout``'s mesh; None: JAX's backend), which picks the kernels (flash: Mosaic on a TPU)."""
    from meshlm.parallel.compile_target import compiling_for
    from meshlm.perf.bench import compiled_memory

    with compiling_for(platform):
        step, params, opt_state, batch = abstract_step(cfg, layout, settings)
        start = time.perf_counter()
        try:
            compiled = step.lower(params, opt_state, batch).compile()
        except Exception as e:  # noqa: BLE001 - a TPU's compiler refuses a program over its memory
            if not is_out_of_memory(e):
                raise
            return refused(e, params, opt_state, batch, time.perf_counter() - start)
        seconds = time.perf_counter() - start
    memory = compiled_memory(compiled)
    if memory is None:
        raise ConfigError(f"XLA's {platform or jax.default_backend()} compiler reports no memory analysis")
    return {
        "params": bytes_per_device(params),
        "opt_state": bytes_per_device(opt_state),
        **memory,
        "compile_s": seconds,
    }


_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
# XLA:TPU's refusal: "... the total memory required for HLO temporaries (22.34G) exceeds available HBM"
_REQUIRED = re.compile(r"HLO temporaries \(([\d.]+)([KMGT])\)")


def refused(error: Exception, params, opt_state, batch, seconds: float) -> dict:
    """The figures of a step the chip's compiler refused to compile (it checks its buffer plan against
    the chip's memory, where XLA:CPU plans any size): the peak it names, the arguments from the shapes,
    the donated state its outputs (aliased), the temporaries the rest; ``refused``: its message. Does
    not fit, surely.

    The named figure is the whole heap, arguments included, whatever the message calls it: llama3.2-1b,
    bf16 moments (9.2 GiB of arguments), --loss-chunk 512, remat full, was refused at batch 2 naming
    15.78G while batch 4 compiled to a 15.31 GiB heap (scripts/chip_fit.py); and qwen3-0.6b's named
    figures continue its compiled batches' peaks (batch 8: 22.59G after 11.70 and 15.63 GiB at 2 and 4)."""
    message = str(error).strip().splitlines()[0]
    found = _REQUIRED.search(message)
    if found is None:
        raise ConfigError(f"the chip's compiler ran out of memory and named no figure: {message}") from None
    state = bytes_per_device(params) + bytes_per_device(opt_state)
    argument = state + bytes_per_device(batch)
    peak = int(float(found.group(1)) * _UNITS[found.group(2)])
    return {
        "params": bytes_per_device(params),
        "opt_state": bytes_per_device(opt_state),
        "peak": peak,
        "argument": argument,
        "output": state,
        "alias": state,
        "temp": max(peak - argument, 0),
        "compile_s": seconds,
        "refused": message,
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
    opt_state = ADAM_MOMENTS * trained * MOMENT_SCALE[settings.opt_dtype]
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
