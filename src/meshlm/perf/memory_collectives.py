"""The collectives a training step needs under the memory options (FSDP over DP, sequence
parallelism over MP), by cause: what the communication check and ``bench`` hold the compiled step to.

Counts are per step (a layer loop that runs L times counts L times) and are upper bounds: XLA may
combine independent collectives over the same devices, or (with remat) not recompute one whose result
the backward does not need. With ``f`` = entries into column-parallel regions per layer (llama 2,
gptj 1, ff 1) and ``r`` = row-parallel exits per layer (the same numbers: ``Family.row_sums``):

* SP (mp > 1) replaces the layer all-reduces. All-gathers: ``f`` per layer forward, again in the
  backward (the gathered sequence is not kept: Korthikanti et al. 2022), the head's input (1), and
  the backward of every reduce-scatter: ``r`` per layer plus the embedding's (1). Reduce-scatters:
  ``r`` per layer forward (again in the backward's recomputation with remat) plus the embedding's
  (1), and the backward of every all-gather: ``f`` per layer plus the head's (1). Parameters
  replicated over MP that meet sequence slices (norms, biases added after a row-parallel sum, a MoE
  layer's router) have their gradients all-reduced over MP (one per leaf and layer, at most). A MoE
  layer's combine weights and expert ids are all-gathered (again in the backward), the weights'
  gradient reduce-scattered; its routing statistics summed over MP too (one all-reduce a step).
* LoRA (mp > 1): an adapter factor replicated over MP (a column-parallel base's A, a row-parallel
  base's B) has its gradient all-reduced over MP: its elements' bytes (the count is not raised: XLA
  combines those sums with the step's others, and a LoRA step reduces no base gradient, so the count
  stays under full training's; a raised count would hide the extra all-reduce control).
* FSDP (dp > 1): each DP-split weight of a layer is all-gathered in the forward and again in the
  backward (ZeRO-3; outside the layer stack XLA may keep the gathered weight or gather it again),
  and its gradient reduce-scattered once (a tied embedding table: once per use, lookup and head).
  Norms and biases stay replicated and keep the data-parallel gradient all-reduce.
* Context parallelism (``--cp``; ``model.context_parallel``), per layer with K and V stacked into one
  array: the ring passes it cp - 1 times forward (again with remat), and in the backward cp - 1 times
  more plus cp passes of its gradient (the last one home): collective-permutes. All-gather: one
  all-gather forward (again with remat) and its transpose, one reduce-scatter, backward. With FSDP the
  DP-split gradients, reduce-scattered over dp, are then summed over cp alone (other replica groups than
  the norms' sum over dp x cp): one all-reduce for the layer stack's and, at most, one per DP-split
  weight outside it (each weight's reduce-scatter is its own; the bytes are the same ``dp_gradients``).
  A hybrid's linear-attention layers (``model.linear_context``) instead all-gather, per layer, the conv's
  tails and the delta rule's state maps (two forward, again with remat; their transposes, two
  reduce-scatters, backward: ``cp_linear``, bytes ``cp_linear_bytes``); its full-attention layers count
  as above.
* Expert parallelism (``--ep``; ``parallel.ep``), per MoE layer, the sorted dispatches: three
  all-gathers forward over EP (tokens, combine weights, ids; again with remat) and the output's
  reduce-scatter (again with remat); backward, its transpose (an all-gather) and the reduce-scatters of
  the tokens' and weights' gradients: ``ep_dispatch_bytes``, N x (ep x (D + 2k) + ...) values, no
  E x N buffer. The "dense" reference instead: two all-to-alls forward (the tokens to their experts'
  shard and the outputs back; again with remat) and their two transposes backward, each of the fixed
  size E x N x D (``ep_all_to_all_bytes``). The expert weights' gradients are summed
  over the data shards outside ep alone (other replica groups than the dense weights' sum over dp):
  one more all-reduce where that axis is > 1 (no bytes beyond ``dp_gradients``'); under FSDP the dense
  weights are split over (dp, ep), every data shard, and reduce-scattered over both, the expert weights
  over dp / ep (where > 1) and reduce-scattered there: nothing left to sum over ep.
* A capacity factor (``moe_capacity_factor``; ``model.moe.capacity_keep``): each MoE layer all-gathers
  its tokens' expert ids and global places over the batch axes (and mp under sp) once forward (again
  with remat): integers, no backward.
"""

from __future__ import annotations

from meshlm.model.accounting import moe_layers
from meshlm.model.config import ModelConfig
from meshlm.model.moe import ROUTER, moe_losses, stats_size
from meshlm.model.mtp_fields import as_layers
from meshlm.model.params import flat_params, is_matmul_weight, is_stacked
from meshlm.parallel.axes import DP, MP
from meshlm.parallel.layout import Layout
from meshlm.perf.collectives import mtp_depths, theoretical_bytes, theoretical_collectives
from meshlm.sharding.rules import dp_sharded, spec_for

# all-reduce causes SP replaces (a MoE layer's combine weights: all-gathered, their gradient scattered)
SP_REPLACES = ("layer_forward", "layer_backward", "embedding", "head_backward", "moe_weights_backward")
SP_REPLACES += ("mtp_embedding", "mtp_eh_proj", "mtp_head_backward")  # an MTP depth's (``model.mtp``)


def sp_replicated(params) -> dict[str, int]:
    """Parameters replicated over MP that meet the sequence slices under SP (norms, and biases added
    after a row-parallel sum): path -> how many gradient all-reduces over MP (once per layer for
    stacked leaves, at most). Read from the rules table, so it follows the model's parameters."""
    out = {}
    for path, p in flat_params(params).items():
        router = path.endswith(ROUTER)  # a weight replicated over mp that meets the slices (``model.moe``)
        if (is_matmul_weight(path) and not router) or MP in spec_for(path, p.shape, 1):
            continue
        out[path] = p.shape[0] if is_stacked(path) else 1  # its stack's layers (a mixed stack: two)
    return out


def lora_replicated(params) -> dict[str, tuple[int, int]]:
    """LoRA's adapter factors replicated over MP (a column-parallel base's A, a row-parallel base's B:
    ``model.lora``): their gradients are partial sums over MP's shards, all-reduced there. path ->
    (its layers: one sum each, elements)."""
    from meshlm.model.lora import is_adapter

    out = {}
    for path, p in flat_params(params).items():
        spec = getattr(getattr(p, "sharding", None), "spec", None)
        if is_adapter(path) and spec is not None and MP not in _axes(spec):
            out[path] = (p.shape[0] if is_stacked(path) else 1, p.size)
    return out


def _axes(spec) -> set:
    return {a for entry in spec for a in (entry if isinstance(entry, tuple) else (entry,)) if a}


def fsdp_weights(params) -> tuple[int, int]:
    """(DP-split weights of the layer stacks, each counted once per layer it stacks; DP-split weights
    outside them) of ``params`` (a mixed stack's two kinds hold different weights: ``model.layer_kinds``)."""
    split = {
        path: p
        for path, p in flat_params(params).items()
        if dp_sharded(getattr(getattr(p, "sharding", None), "spec", ()))
    }
    stacked = [p.shape[0] for path, p in split.items() if is_stacked(path)]
    return sum(stacked), len(split) - len(stacked)


def expected_collectives(cfg: ModelConfig, layout: Layout, *, params) -> dict[str, dict]:
    """Per kind ("all-reduce", "all-gather", "reduce-scatter") the causes and their ``total`` on
    ``layout`` (FSDP read from ``params``' shardings)."""
    dp, mp, sp = layout.dp, layout.mp, layout.sp
    ar = dict(theoretical_collectives(cfg, dp, mp, layout.cp))
    mtp, cfg = mtp_depths(cfg), as_layers(cfg)  # MTP's blocks: more layers of the main kind
    ag: dict[str, int] = {}
    rs: dict[str, int] = {}
    cperm: dict[str, int] = {}
    n, pl = cfg.n_layers, cfg.arch.row_sums  # f entries = r exits per layer
    recompute = 2 if cfg.remat != "none" else 1
    if layout.context_parallel and cfg.arch.attention:
        full = cfg.n_layers - _linear_count(cfg)  # the full-attention layers
        if layout.cp_ring:
            cperm.update(
                cp_ring_forward=recompute * (layout.cp - 1) * full,
                cp_ring_backward=(2 * layout.cp - 1) * full,
            )
        else:
            ag.update(cp_kv_forward=recompute * full)
            rs.update(cp_kv_backward=full)
    if sp and mp > 1:
        for cause in SP_REPLACES:
            if cause in ar:
                ar[cause] = 0
        ar["sp_replicated_grads"] = sum(sp_replicated(params).values())
        # an MTP depth: its ids' lookup scattered, eh_proj's input gathered and output scattered, the
        # head's input gathered; each transposed in the backward
        ag.update(sp_forward=2 * pl * n + 1 + 2 * mtp, sp_backward=pl * n + 1 + 2 * mtp)
        rs.update(sp_forward=recompute * pl * n + 1 + 2 * mtp, sp_backward=pl * n + 1 + 2 * mtp)
        if cfg.arch.moe:  # the combine weights and ids gathered (again in the backward), weights' grads
            ag.update(moe_routing=4 * moe_layers(cfg))
            rs.update(moe_routing=moe_layers(cfg))
            ar["moe_statistics"] = int(moe_losses(cfg))  # over mp too: each shard routed its slice
    layer_weights, outside = fsdp_weights(params)
    if cfg.tie_embeddings and outside:  # the tied table is gathered for the lookup and for the head
        outside += 1
    if dp > 1 and layer_weights + outside:
        ag.update(fsdp_layers=2 * layer_weights, fsdp_outside=2 * outside)
        rs.update(fsdp_gradients=layer_weights + outside)
        if mtp:  # the table and the head met again by each MTP depth: their parts scattered apart
            rs["fsdp_mtp_shared"] = 2 * mtp
        if layout.context_parallel:  # DP-split gradients then summed over cp (with ep: FSDP covers it)
            ar["cp_fsdp_gradients"] = 1 + outside
    if cfg.arch.moe and cfg.moe_capacity_factor and layout.dp * layout.cp * (mp if sp else 1) > 1:
        ag["moe_capacity"] = recompute * moe_layers(
            cfg
        )  # the routing ids of the whole batch (``model.moe.capacity_keep``)
    a2a = ep_all_to_alls(cfg, layout)
    for more_ag, more_rs in (ep_dispatch(cfg, layout), cp_linear(cfg, layout)):
        ag.update(more_ag)
        rs.update(more_rs)
    if (
        layout.experts_split and layout.mesh_shape[DP] > 1 and not layout.fsdp
    ):  # experts' gradients: over dp / ep alone
        ar["ep_expert_gradients"] = 1
    for causes in (ar, ag, rs, cperm, a2a):
        causes.pop("total", None)
        causes["total"] = sum(causes.values())
    return {
        "all-reduce": ar,
        "all-gather": ag,
        "reduce-scatter": rs,
        "collective-permute": cperm,
        "all-to-all": a2a,
    }


def _linear_count(cfg: ModelConfig) -> int:
    """A hybrid's linear-attention layers (``model.layer_kinds``), 0 for a model without."""
    return len(cfg.linear_layers) if getattr(cfg, "full_attn_every", 0) else 0


def cp_linear(cfg: ModelConfig, layout: Layout) -> tuple[dict[str, int], dict[str, int]]:
    """The all-gathers and reduce-scatters of linear-attention layers under cp per step, by cause."""
    n = _linear_count(cfg) if layout.context_parallel else 0
    if not n:
        return {}, {}
    recompute = 2 if cfg.remat != "none" else 1
    return {"cp_linear_forward": 2 * recompute * n}, {"cp_linear_backward": 2 * n}


def cp_linear_bytes(cfg: ModelConfig, layout: Layout, *, batch: int, seq_len: int, itemsize: int) -> int:
    """Result bytes per step and device of ``cp_linear``'s all-gathers: per layer (again with remat)
    the tails [cp, B, 2, K-1, C] of the C = (2 Kh dk + Vh dv) / mp conv channels, in the activations'
    dtype, and the maps [cp, B, 2, Vh / mp, dk, dv + dk] in at least float32 (B = batch / dp;
    constant in seq_len)."""
    if not cp_linear(cfg, layout)[0]:
        return 0
    recompute = 2 if cfg.remat != "none" else 1
    rows, dk, dv = layout.cp * (batch // layout.dp) * 2, cfg.linear_key_dim, cfg.linear_value_dim
    channels = (2 * cfg.linear_key_heads * dk + cfg.linear_value_heads * dv) // layout.mp
    tails = rows * (cfg.linear_conv - 1) * channels * itemsize
    maps = rows * cfg.linear_value_heads // layout.mp * dk * (dv + dk) * max(itemsize, 4)
    return recompute * _linear_count(cfg) * (tails + maps)


def ep_dispatch(cfg: ModelConfig, layout: Layout) -> tuple[dict[str, int], dict[str, int]]:
    """The all-gathers and reduce-scatters of the sorted dispatches under ep per step, by cause ({}
    without ep, or with the "dense" reference's all-to-alls)."""
    if not layout.experts_split or cfg.moe_dispatch == "dense":
        return {}, {}
    recompute, layers = 2 if cfg.remat != "none" else 1, moe_layers(cfg)
    ag = {"ep_dispatch_forward": 3 * recompute * layers, "ep_dispatch_backward": layers}
    return ag, {"ep_dispatch_forward": recompute * layers, "ep_dispatch_backward": 2 * layers}


def ep_dispatch_bytes(cfg: ModelConfig, layout: Layout, *, batch: int, seq_len: int, itemsize: int) -> dict:
    """Result bytes per step and device of those all-gathers and reduce-scatters, {kind: bytes}: N =
    (batch / dp) x (seq_len / cp) tokens per shard (the column-parallel view, as for the all-to-alls),
    gathered [ep x N, D] tokens, [ep x N, k] weights and int32 ids, scattered [N, D] outputs; backward
    the output's gradient gathered, the tokens' and weights' gradients scattered."""
    cfg = as_layers(cfg)  # an MTP depth's MoE block too
    if not ep_dispatch(cfg, layout)[0]:
        return {}
    recompute, layers = 2 if cfg.remat != "none" else 1, moe_layers(cfg)
    n, ep, d, k = (batch // layout.dp) * (seq_len // layout.cp), layout.ep, cfg.d_model, cfg.experts_per_token
    forward = ep * n * ((d + k) * itemsize + 4 * k)
    gathers = layers * (recompute * forward + ep * n * d * itemsize)
    scatters = layers * (recompute * n * d + n * (d + k)) * itemsize
    return {"all-gather": gathers, "reduce-scatter": scatters}


def ep_all_to_alls(cfg: ModelConfig, layout: Layout) -> dict[str, int]:
    """The all-to-alls of expert parallelism per step, by cause ({} without ep or with a sorted
    dispatch: ``ep_dispatch``)."""
    if not layout.experts_split or cfg.moe_dispatch != "dense":
        return {}
    recompute = 2 if cfg.remat != "none" else 1
    return {
        "ep_dispatch_forward": 2 * recompute * moe_layers(cfg),
        "ep_dispatch_backward": 2 * moe_layers(cfg),
    }


def ep_all_to_all_bytes(cfg: ModelConfig, layout: Layout, *, batch: int, seq_len: int, itemsize: int) -> int:
    """Result bytes of those all-to-alls per step and device: each moves the fixed-size buffer
    [ep, E / ep, N, D] = E x N x D values, N = (batch / dp) x (seq_len / cp) tokens of this shard (the
    MoE layer's input is the column-parallel view: the whole sequence of its cp shard even under sp)."""
    cfg = as_layers(cfg)  # an MTP depth's MoE block too
    a2a = ep_all_to_alls(cfg, layout)
    tokens = (batch // layout.dp) * (seq_len // layout.cp)
    return sum(a2a.values()) * cfg.n_experts * tokens * cfg.d_model * itemsize


def expected_all_reduce_bytes(cfg: ModelConfig, layout: Layout, *, params, **shape) -> int:
    """Result bytes of the all-reduces (``theoretical_bytes``'s causes), without those SP replaces
    and with the gradients of the parameters SP leaves replicated over MP (``sp_replicated``: norms,
    and biases added after a row-parallel sum, e.g. the ff family's; each leaf's bytes once, its
    layers stacked in it) (``shape``: batch, seq_len, itemsize)."""
    from meshlm.parallel.placement import bytes_per_device

    out = theoretical_bytes(
        cfg, layout.dp, layout.mp, param_bytes=bytes_per_device(params), cp=layout.cp, **shape
    )
    total = out["total"]
    if layout.sp and layout.mp > 1:
        total -= sum(out.get(c, 0) for c in SP_REPLACES)
        if moe_losses(cfg) and not out["moe_statistics"]:  # summed over mp alone (dp x cp = 1)
            total += moe_layers(cfg) * stats_size(cfg) * shape["itemsize"]
        replicated = sp_replicated(params)  # norms, row biases and the router
        total += (
            sum(p.size for path, p in flat_params(params).items() if path in replicated) * shape["itemsize"]
        )
    if cfg.lora_rank and layout.mp > 1:  # an adapter factor replicated over mp: its gradient summed there
        total += sum(size for _, size in lora_replicated(params).values()) * shape["itemsize"]
    return total
