"""How the model meets the memory options: rematerialisation policies, and the Haiku getter through
which every parameter passes (FSDP all-gathers, the sequence-parallel norm hook: ``Parallel.param``).

Remat (``ModelConfig.remat``), per layer of the stack:
  none       keep every activation the backward needs but all-gather results: FSDP weights are
             gathered again in the backward (ZeRO-3), and with SP so is each block's input
             (Korthikanti et al. 2022 keep the sequence slice, not the gathered sequence)
  full       keep only each layer's input; recompute the layer in the backward
  selective  keep the matmul outputs (dots without batch dimensions: the Q/K/V/O projections and the
             MLP), recompute the attention scores and softmax (batched dots) and the elementwise work
  save_qkv_proj    keep the query, key and value projections (MaxText's policy of that name); recompute
             the rest: attention, the output projection, the MLP
  save_qkv_mlp_in  keep those and the MLP's input projections (gate and up, or w_in); recompute the
             attention, the activation and the down/output projections
  save_qkv_attn    keep q/k/v and the attention's output ("attn_out"; with flash attention the
             kernel's output and log-sum-exp, its backward's residuals): no attention recomputed, only
             the norms and rotary embedding (elementwise), the output projection and the MLP
The named ones save what the layers tag with ``jax.ad_checkpoint.checkpoint_name`` ("q_proj", "k_proj",
"v_proj" in the attention, "mlp_in" in the dense MLP, "attn_out" on the attention's result): a model
without those layers refuses them (``ModelConfig``). Between selective and full: they keep 2 to 3 of a
layer's ~7 matmul outputs.
"""

from __future__ import annotations

import haiku as hk
import jax

from meshlm.model.family import REMAT  # noqa: F401 - the choices, re-exported with their meaning
from meshlm.model.flash_kernel import ATTN_OUT  # the attention's result; flash: the kernel's out, lse
from meshlm.model.params import EXPERTS_MODULE, leaf_name
from meshlm.parallel.context import Parallel

NORM_PARAMS = ("scale", "offset")
QKV = ("q_proj", "k_proj", "v_proj")
SAVED_NAMES = {  # the named policies' names
    "save_qkv_proj": QKV,
    "save_qkv_mlp_in": (*QKV, "mlp_in"),
    "save_qkv_attn": (*QKV, ATTN_OUT),
}


def _policy(remat: str):
    if remat == "full":
        return None  # jax.checkpoint's default: save nothing but the inputs
    if remat == "selective":
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    if remat in SAVED_NAMES:
        return jax.checkpoint_policies.save_only_these_names(*SAVED_NAMES[remat])
    return _all_but_gathers


def _all_but_gathers(prim, *_, **__) -> bool:
    """A checkpoint policy: save every intermediate except the results of all-gathers."""
    return prim.name != "all_gather"


def remat_body(remat: str, body, gathers: bool = True):
    """``body`` (one layer) under the checkpoint policy of ``remat``. "none" saves everything but
    all-gather results; where the layer has none (``gathers`` False: no FSDP, no SP) it is the plain
    layer, not wrapped at all. Why not the save-everything checkpoint there too: ``jax.checkpoint``
    marks the producer of every residual it saves with a ``reduce_precision`` to its own dtype (JAX
    PR 22244), a no-op in value that XLA cannot fuse through, so every residual is materialised as
    saved. On a TPU v5e chip that cost the llama-100m step 1.24x plain JAX's time and 1.75x its memory
    (docs/benchmarks.md, "On a TPU chip"); on CPU it is invisible."""
    if remat == "none" and not gathers:
        return body
    return hk.remat(body, policy=_policy(remat))


def layer_gathers(par: Parallel) -> bool:
    """Whether a layer all-gathers inside (FSDP's weights, SP's sequence): what "none" must not save."""
    return par.layout.fsdp or par.layout.sp


def parallel_getter(par: Parallel):
    """A Haiku custom getter: each parameter as ``par`` has the layers use it (``Parallel.param``);
    the value a layer asked for has the shape it requested, so layers are unchanged. Expert weights
    pass the ``expert_weight`` tap (identity: where the proof plants an expert-gradient fault)."""

    def getter(next_getter, value, context):
        shape = context.original_shape
        used = par.param(value, shape, leaf_name(context.full_name) in NORM_PARAMS)
        if context.module_name.rsplit("/", 1)[-1] == EXPERTS_MODULE:
            used = par.tap("expert_weight", used)
        return next_getter(used)

    return getter
