"""What the proof proves: a loss builder, its parameters' specs and the inputs (``Problem``), and
``model_problem`` for a meshlm model config."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from math import gcd

import numpy as np

from meshlm.parallel.context import Parallel
from meshlm.parallel.layout import Layout


@dataclass(frozen=True)
class Problem:
    """What to prove: a loss builder, its parameters' specs, inputs and (optionally) a config."""

    build_loss: Callable[[Parallel], Callable]  # par -> Haiku fn(batch) -> scalar loss
    specs_fn: Callable  # abstract params -> PartitionSpec tree (from a rules table)
    batch: dict  # {"inputs", "targets"}: global [B, T] host arrays
    name: str = "model"
    cfg: object = None  # a ModelConfig enables the config-level controls
    rebuild: Callable | None = None  # cfg -> build_loss, for config-level controls
    has_row_bias: bool = True  # whether row-parallel biases exist (for that control)
    load_params: Callable | None = None  # Layout -> params to prove with, instead of a fresh init
    # The reference's own loss when it is another model than the sharded one: the unpadded model of a
    # padded vocabulary (None: build_loss). Trees move between the two shapes with these maps.
    reference_loss: Callable | None = None  # par -> Haiku fn(batch) -> scalar loss
    to_reference: Callable = lambda tree: tree  # sharded-shaped tree -> the reference's shapes
    from_reference: Callable = lambda tree: tree  # the reference's tree -> sharded shapes
    fsdp: bool = False  # weights (and their optimizer moments) split over DP; specs_fn says where
    sp: bool = False  # sequence parallelism over MP in the sharded run
    # (shape, seed) -> a batch like ``batch``, for the training steps; None: uniform random ids
    batch_fn: Callable | None = None
    # params -> the parameters both runs start from (a mixture of experts': a planted router tie)
    prepare_params: Callable | None = None
    # Uneven pipeline stages' padded stack (``sharding.stage_slots.Slots``): the sharded run's parameters
    # are padded from the init, the reference's trees move through ``to_reference`` / ``from_reference``
    slots: object = None
    # The reference's model config when ``cfg`` is set (``reference_loss``'s): the routing probe's
    # reference runs it (``proof.routing``); None: ``cfg``
    reference_cfg: object = None
    opt_dtype: str = "float32"  # AdamW's moments as stored in the training steps (``train.optim.OPT_DTYPES``)


def random_batch(vocab: int, shape: tuple[int, ...], seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {k: rng.integers(0, vocab, size=shape, dtype=np.int32) for k in ("inputs", "targets")}


def reference_chunk(chunk: int, seq_len: int, cp: int) -> int:
    """The delta rule's chunk length in the reference of a proof on ``cp`` shards: one whose chunk
    boundaries are the sharded run's. Under cp each shard runs the chunked rule on its two cp chunks of
    c = T / 2cp tokens (``model.linear_context``), so the shards solve chunks of min(chunk, c) from every
    cp chunk's start. The chunked form equals the recurrence for every chunk length
    (``tests/test_deltanet.py``), but its float64 rounding grows with the length (a unit-lower-triangular
    solve per chunk: the converted tiny Qwen3.5's gradients on 64 tokens against the recurrence, chunks
    of 64 up to 1.5e-12, 16 up to 7.3e-13, 8 up to 7.8e-14 normwise). A reference in chunks of 64 against
    the shards' chunks of 16 differed from them by that rounding (issue 59: 2.4e-12 after a step), not by
    the sharding; at the shards' boundaries both solve the same systems, and the comparison sees what cp
    adds (the state maps, the conv tails). Where the chunk length neither divides c nor exceeds it,
    gcd(chunk, c): every boundary of the shards' is one of the reference's."""
    c = seq_len // (2 * cp)
    return c if chunk >= c else gcd(chunk, c)


def _same(tree):
    return tree


def model_problem(
    cfg, name: str, layout: Layout | int, batch_size: int, seq_len: int, seed: int = 0, **sizes
) -> Problem:
    """A Problem for a meshlm model config on ``layout``: random token inputs and targets (global
    [B, T]); the parameters' specs are the rules table's on that layout (its memory options, pp's split
    layers, ep's experts). An int ``layout`` is mp, with ``sizes`` (dp, fsdp, sp) the rest of a
    dp x mp layout (the tests' shorthand)."""
    from meshlm.model.padding import resize_tree
    from meshlm.model.transformer import loss_fn
    from meshlm.proof.documents import document_batch

    layout = layout if isinstance(layout, Layout) else Layout(mp=layout, **sizes)
    from meshlm.sharding.rules import model_specs
    from meshlm.sharding.stage_slots import slots_of

    rebuild = lambda c: lambda par: loss_fn(c, par)
    batch_fn = None  # uniform random ids; with the document mask, windows of many documents
    if cfg.doc_mask >= 0:
        batch_fn = lambda shape, s: document_batch(cfg.vocab_size, cfg.doc_mask, shape, s)
    # The reference is the plainest program: no recomputation, every layer unrolled (the sharded
    # side's remat policy and layer loop are proven against code they do not share).
    # Blockwise attention is proven against the plain softmax of [T, T] scores, a mixture of experts'
    # sorted dispatch against every expert on every token (``parallel.experts.dense_experts``), the
    # chunked cross-entropy (``--loss-chunk``) against the whole [B, T, V] logits' loss.
    plain = cfg.replace(remat="none", unroll=0, attention="plain", moe_dispatch="dense", loss_chunk=0)
    if (
        cfg.linear_layers and layout.context_parallel
    ):  # the delta rule solved at the sharded run's chunk boundaries
        plain = plain.replace(linear_chunk=reference_chunk(cfg.linear_chunk, seq_len, layout.cp))
    padding = {}
    if cfg.padded_vocab != cfg.vocab_size:  # the proof: padded sharded model == the unpadded one
        plain = plain.replace(vocab_multiple=1)
        padding = dict(
            to_reference=lambda tree: resize_tree(tree, cfg.vocab_size),
            from_reference=lambda tree: resize_tree(tree, cfg.padded_vocab),
        )
    slots = slots_of(cfg, layout)
    if slots is not None:  # uneven pp stages: the reference has the real layers (``sharding.stage_slots``)
        to_ref, from_ref = padding.get("to_reference", _same), padding.get("from_reference", _same)
        padding = dict(
            to_reference=lambda tree: to_ref(slots.unpad(tree)),
            from_reference=lambda tree: slots.pad(from_ref(tree)),
            slots=slots,
        )
    prepare = None
    if cfg.arch.moe:  # a tie in every layer's routing, for the tie-breaking control (``proof.moe_controls``)
        from meshlm.proof.moe_controls import plant_router_tie

        prepare = partial(plant_router_tie, ep=layout.ep)
        if cfg.balance_bias:  # a nonzero selection bias, keeping the tie (``proof.router_controls``)
            from meshlm.proof.router_controls import plant_balance_bias

            prepare = lambda p, tie=prepare: plant_balance_bias(tie(p), ep=layout.ep)
    return Problem(
        prepare_params=prepare,
        build_loss=rebuild(cfg),
        specs_fn=lambda abstract: model_specs(cfg, abstract, layout),
        batch=(batch_fn or partial(random_batch, cfg.vocab_size))((batch_size, seq_len), seed),
        batch_fn=batch_fn,
        name=name,
        cfg=cfg,
        rebuild=rebuild,
        reference_loss=rebuild(plain),
        reference_cfg=plain,
        has_row_bias=cfg.arch.biases or cfg.embed_bias,
        **padding,
        fsdp=layout.fsdp,
        sp=layout.sp,
    )
