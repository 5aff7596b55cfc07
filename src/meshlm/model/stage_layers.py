"""Pipeline stages over a stack of two layer kinds (``--pp``; ``sharding.pipelined``): which layers each
stage runs, decided here once from the config (``model.layer_kinds``) and the chunk count pp x V.

Every stage runs one program (SPMD: one ``shard_map`` body), so every chunk of the pipelined body must
hold the same layers: per layer its parameter stack and its attention kind (Gemma 2/3's and Llama 4's
``global_every``: ``attention.layer_kinds``). Two shapes of stack qualify:

* **Periodic**: the chunks' patterns of kinds are equal (each chunk whole periods: Qwen3.5's 3 linear
  + 1 full attention layers, an interleaved MoE's dense + MoE pairs). Each kind's stack [count, ...]
  then splits over the chunks as a uniform one does (count / chunks per chunk), and a chunk runs its
  runs of same-kind layers as the whole model does (``stack._mixed_stack``) with a config of its own
  length (``chunk_config``).
* **A dense prefix** (DeepSeek-V3's ``first_k_dense_replace``, Qwen2-MoE's leading ``mlp_only_layers``):
  dense layers 0 .. p - 1 before MoE layers only. They run with the embedding on the first stage
  (``pieces.embed_fn``: the schedule runs it inside the first chunk's forward slot, its VJP in that
  chunk's backward slot), their parameters stored and passed like the embedding's (replicated over pp);
  the MoE layers, uniform, split over the stages. The first stage does p layers' more work per
  micro-batch (and under 1F1B their forward twice: the embedding's VJP recomputes it).

**Uneven stages** (DeepSeek-V3's 58 MoE layers on 4 stages; a dense model's odd layer count on 2): when
a body of one layer kind (after any dense prefix, no ``global_every``) does not split into the chunks,
each chunk gets ``ceil(body / chunks)`` slots and the missing ones are *padding slots* (``slots``):
they hold zero parameters, act as the identity (``sharding.stage_slots``: the slot's output is its
input, so its gradients are exactly zero and AdamW keeps them zero), and their routing statistics are
dropped before the aux and z losses, the routing metrics and the bias balancing see them. Padding goes
to the first chunks (greedily, at most ``S - 1`` per chunk, at each chunk's end): the first stage runs
the embedding and the dense prefix already. The padded stack exists only in the pipelined device
layout; checkpoints, export, evaluation, the proof's reference and ``meshlm configs`` see the real
layers (``sharding.stage_slots``: the one place that converts, both ways). Chosen over running the
remainder layers with the embedding or the head (as the dense prefix): those would be stored replicated
over pp on every stage (1 - 2 MoE layers of DeepSeek-V3 each ~11 B parameters) and make the first or last
stage slower still. Uneven stages with virtual stages, or over a stack of two kinds, are refused.

Anything else is refused in one line naming the rule and the pp values that work
(``sharding.rules.check_uniform_stack``, the one place that refuses).

This module must not import JAX: the check runs before devices exist (``meshlm plan``).
"""

from __future__ import annotations

import numpy as np

from meshlm.model.layer_kinds import DENSE_STACK, LINEAR_STACK, MOE_STACK, runs


def prefix(cfg) -> int:
    """The dense layers run with the embedding on the first stage: p when the dense layers are exactly
    0 .. p - 1 (a MoE's dense prefix), else 0."""
    dense = cfg.dense_layers
    return len(dense) if dense and dense == tuple(range(len(dense))) else 0


def prefix_stacks(cfg) -> tuple[str, ...]:
    """The parameter stacks (module names) that travel with the embedding: the dense prefix's."""
    return (DENSE_STACK,) if prefix(cfg) else ()


def signature(cfg) -> list[tuple[str, int]]:
    """Per layer: (its parameter stack, its attention kind: 1 global, 0 local, -1 alike)."""
    names = [name for name, first, start, stop in runs(cfg) for _ in range(stop - start)]
    every = cfg.global_every  # ``attention.layer_kinds``'s rule (that module imports JAX)
    kinds = ((np.arange(cfg.n_layers) + 1) % every == 0).astype(int) if every else [-1] * cfg.n_layers
    return list(zip(names, (int(k) for k in kinds), strict=True))


def chunk_config(cfg, n: int):
    """The config a pipeline chunk of ``n`` layers runs (``sharding.pipelined.stage_fn``): the body's
    first ``n`` layers' kinds, numbered from 0 (every chunk's are the same: ``stage_problem``)."""
    p = prefix(cfg)
    dense = () if p else tuple(i for i in cfg.dense_layers if i < n)
    return cfg.replace(n_layers=n, unroll=min(cfg.layer_unroll, n), dense_layers=dense)


def one_kind_body(cfg) -> bool:
    """Whether the pipelined body (after a dense prefix) is one stack of one attention kind: the body
    uneven stages can pad (``slots``)."""
    p = prefix(cfg)
    return not cfg.global_every and len({name for name, _ in signature(cfg)[p:]}) == 1


def slots(cfg, chunks: int, virtual_stages: int = 1) -> tuple[int, tuple[int, ...]] | None:
    """Uneven stages: None where the body splits into ``chunks`` equal chunks; else (slots per chunk S,
    each body layer's slot in the padded stack [chunks x S], in order). Chunk k's padding sits at its
    end, the first chunks taking it (at most S - 1 each: every chunk keeps a layer)."""
    body = cfg.n_layers - prefix(cfg)
    if not body % chunks or body < chunks or virtual_stages > 1 or not one_kind_body(cfg):
        return None
    per = -(-body // chunks)
    pads, left = [], chunks * per - body
    for _ in range(chunks):
        pads.append(min(left, per - 1))
        left -= pads[-1]
    real = tuple(k * per + i for k in range(chunks) for i in range(per - pads[k]))
    return per, real


def stage_problem(cfg, chunks: int, virtual_stages: int = 1) -> str | None:
    """Why ``chunks`` pipeline chunks cannot each run the same layers, or None: they can (uneven
    stages of a one-kind body: with padding slots, ``slots``)."""
    p = prefix(cfg)
    body = cfg.n_layers - p
    head = f"after the {p} dense layers (run with the embedding) " if p else ""
    if body % chunks and not slots(cfg, chunks, virtual_stages):
        why = "of two layer kinds" if not one_kind_body(cfg) else "with virtual stages"
        why = f"more chunks than {body} layers" if body < chunks else why
        return (
            f"{head}{body} layers do not split into {chunks} chunks of equal size (uneven stages are "
            f"padded for a body of one layer kind without virtual stages, not {why})"
        )
    if body % chunks:
        return None
    c = body // chunks
    sig = signature(cfg)[p:]
    if any(sig[k * c : (k + 1) * c] != sig[:c] for k in range(chunks)):
        every = f"; global_every={cfg.global_every}" if cfg.global_every else ""
        return f"chunks of {c} layers hold different patterns of layer kinds ({_pattern(sig)}{every})"
    if signature(chunk_config(cfg, c)) != sig[:c]:  # e.g. a period that does not start at a chunk
        return f"a chunk of {c} layers does not number its kinds as the model does ({_pattern(sig)})"
    return None


def working_pp(cfg, virtual_stages: int = 1) -> list[int]:
    """The pp values (>= 2) whose chunks pass ``stage_problem``."""
    return [
        pp
        for pp in range(2, cfg.n_layers + 1)
        if stage_problem(cfg, pp * virtual_stages, virtual_stages) is None
    ]


_LETTERS = {MOE_STACK: "m", DENSE_STACK: "d", LINEAR_STACK: "l"}


def _pattern(sig) -> str:
    """The body's layers as letters (m: the main stack's, d: dense, l: linear attention; upper-case:
    a global layer), e.g. "lm" for Qwen3.5's linear then full attention layer."""
    letters = "".join(_LETTERS[name].upper() if kind == 1 else _LETTERS[name] for name, kind in sig)
    return f"layer by layer {letters if len(letters) <= 16 else letters[:16] + '...'}"
