"""Parameter sharding: one ordered table from parameter path to its logical dimensions, first match
wins; the layout maps logical dimensions to mesh axes.

Rows name each of a parameter's own dimensions logically (``vocab``, ``embed``, ``heads``,
``kv_heads``, ``head_dim``, ``mlp``); parameters stacked by ``layer_stack`` (paths starting with
``layers/``) get a leading ``layers`` dimension. Which mesh axis splits a logical dimension is the
axes' declaration (``parallel.axes.Axis.dims``: mp splits vocab, heads, kv_heads and mlp; pp, when
on, the layers; with ``--fsdp`` dp also splits each weight's ``embed`` dimension), read through
``Layout.logical_axes``: a new axis is a mapping entry there, not edits to the rows. KV heads are
replicated instead when mp exceeds them (``model_specs``). A row may also name mesh axes directly
(a user's table: ``examples/custom_model.py``). A parameter no rule matches, or a sharded dimension
the mesh does not divide, is an error naming both: nothing is quietly replicated.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshlm.errors import ConfigError, ShardingError
from meshlm.model import layer_kinds, stage_layers
from meshlm.model.params import is_embedding, is_matmul_weight, is_stacked, is_table, param_path
from meshlm.parallel.axes import DP, EP, LOGICAL_DIMS, MP, PP
from meshlm.parallel.layout import Layout
from meshlm.parallel.pipeline_schedule import check_layers

# The logical dimensions rows name (``parallel.axes.LOGICAL_DIMS``).
VOCAB, EMBED, HEADS, KV, HEAD_DIM, MLP, LAYERS, EXPERTS = LOGICAL_DIMS  # KV: on MP, or replicated when mp > K

# (regex on "module/param", logical dims of the parameter's own dims). Global shapes in the comments.
RULES: tuple[tuple[str, tuple], ...] = (
    (r"^embed/embeddings$", (VOCAB, EMBED)),  # [V, D]: contiguous vocab slices
    (r"^embed/b$", (EMBED,)),  # [D]: added once after the all-reduce
    (r"^head/w$", (EMBED, VOCAB)),  # [D, V]
    (r"^head/b$", (VOCAB,)),  # [V]
    (r"/attn/wq$", (EMBED, HEADS, HEAD_DIM)),  # [D, H, E] (gated: [D, H, 2E], query then gate): by heads
    (r"/attn/w[kv]$", (EMBED, KV, HEAD_DIM)),  # [D, K, E]: by KV heads, or replicated when mp > K
    (r"/attn/wo$", (HEADS, HEAD_DIM, EMBED)),  # [H, E, D]: row-parallel
    (r"/attn/bq$", (HEADS, HEAD_DIM)),  # [H, E]: Qwen2's q bias, sliced with its heads
    (r"/attn/b[kv]$", (KV, HEAD_DIM)),  # [K, E]: with the KV heads, or replicated when mp > K
    (r"/attn/[qk]_norm/scale$", (HEAD_DIM,)),  # [E]: Qwen3's per-head q/k norm, shared by every head
    (r"/attn/q_norm/scale_heads$", (HEADS, HEAD_DIM)),  # [H, E]: OLMo 2's q norm over H*E, with its heads
    (r"/attn/k_norm/scale_heads$", (KV, HEAD_DIM)),  # [K, E]: OLMo 2's k norm, with the KV heads
    (r"/attn/bo$", (EMBED,)),  # [D]: gpt-oss's output bias, replicated, added once (``layers.add_once``)
    (r"/attn/sinks$", (HEADS,)),  # [H]: learned attention sinks (gpt-oss), one per query head, with it
    # MLA (``model.mla``): the down-projections to the latents and their norms replicated, the
    # up-projections column-parallel by heads (the output is ``/attn/wo``'s, [H, Ev, D]).
    (r"/attn/w(q_a|kv_a)$", (EMBED, None)),  # [D, Q], [D, r + R]
    (r"/attn/(q_a|kv_a)_norm/scale$", (None,)),  # [Q], [r]
    (r"/attn/wq_b$", (None, HEADS, HEAD_DIM)),  # [Q, H, E]
    (r"/attn/wkv_b$", (None, HEADS, None)),  # [r, H, N + Ev]
    (r"/mlp/w_(in|gate|up)$", (EMBED, MLP)),  # [D, F]: column-parallel
    (r"/mlp/b_in$", (MLP,)),  # [F]
    (r"/mlp/w_(out|down)$", (MLP, EMBED)),  # [F, D]: row-parallel
    (r"/mlp/b_out$", (EMBED,)),  # [D]: added once after the all-reduce
    # Mixture of experts (``model.moe``): the router replicated (no axis splits its E), each expert's
    # hidden units split as the dense MLP's, the experts' leading dim on no axis without ``ep``.
    (r"/moe/router/w$", (EMBED, None)),  # [D, E]
    (r"/moe/router/(b|balance_bias|expert_scale)$", (None,)),  # [E]: gpt-oss's logit bias; the selection
    # bias; Gemma 4's per-expert scale
    (r"/moe/router/scale$", (None,)),  # [D]: Gemma 4's router input scale, replicated (as the input)
    (r"/moe/experts/w_(gate|up)$", (EXPERTS, EMBED, MLP)),  # [E, D, I]: column-parallel
    (r"/moe/experts/w_down$", (EXPERTS, MLP, EMBED)),  # [E, I, D]: row-parallel
    (r"/moe/experts/b_(gate|up)$", (EXPERTS, MLP)),  # [E, I]: with their columns (gpt-oss)
    (r"/moe/experts/b_down$", (None, EMBED)),  # [E, D]: every expert's, added once (``model.moe``)
    (r"/moe/shared(_experts)?/w_(gate|up)$", (EMBED, MLP)),  # [D, I_shared]: the shared experts
    (r"/moe/shared(_experts)?/w_down$", (MLP, EMBED)),  # [I_shared, D]
    (r"/moe/shared_gate/w$", (EMBED, None)),  # [D, 1]
    # Linear attention (``model.linear_attention``): key and value heads both split over mp in
    # contiguous slices (each key head stays with the value heads it serves), the conv per channel.
    (r"/linear/w[qkvz]$", (EMBED, HEADS, HEAD_DIM)),  # [D, Kh, dk] / [D, Vh, dv]: column-parallel
    (r"/linear/w[ab]$", (EMBED, HEADS)),  # [D, Vh]
    (r"/linear/conv_[qkv]$", (None, HEADS, HEAD_DIM)),  # [K, heads, e]: with their heads
    (r"/linear/(a_log|dt_bias)$", (HEADS,)),  # [Vh]
    (r"/linear/norm/scale$", (HEAD_DIM,)),  # [dv]: the gated norm's, shared by every head
    (r"/linear/wo$", (HEADS, HEAD_DIM, EMBED)),  # [Vh, dv, D]: row-parallel
    # [D]: replicated (Gemma 4's MoE block: post_mlp_ln1, moe_ln, post_moe_ln)
    (r"(^|/)(ln|ln2|final_ln|post_attn_ln|post_mlp_ln1?|moe_ln|post_moe_ln)/(scale|offset)$", (EMBED,)),
    # Multi-token prediction (``model.mtp``): eh_proj row-parallel over its joined [embedding; hidden]
    # inputs, the depth's own norms replicated; its block's parameters match the layer rows above.
    (r"^mtp_\d+/eh_proj/w$", (MLP, EMBED)),  # [2D, D]
    (r"^mtp_\d+/(enorm|hnorm|head_norm)/scale$", (EMBED,)),  # [D]
    # Per-layer inputs (``model.per_layer``): their table vocabulary-parallel, the rest replicated.
    (r"^embed_per_layer/embeddings$", (VOCAB, None)),  # [V', L x P]
    (r"^ple_proj/w$", (EMBED, None)),  # [D, L x P]
    (r"(^|/)(ple_norm|ple/ple_ln)/scale$", (None,)),  # [P], [D]
    (r"/ple/gate/w$", (EMBED, None)),  # [D, P]
    (r"/ple/out/w$", (None, EMBED)),  # [P, D]
    (r"/layer_scalar/scale$", (None,)),  # [1]: Gemma 4's fixed per-layer scale
    # LoRA adapters (``model.lora``): A [in, R], B [R, out] split as their base's in / out dims (a
    # column-parallel base's B over mp, a row-parallel base's A); the rank R on no axis.
    (r"/attn/lora_w[qkv]_a$", (EMBED, None)),  # [D, R]
    (r"/attn/lora_wq_b$", (None, HEADS, HEAD_DIM)),  # [R, H, E]
    (r"/attn/lora_w[kv]_b$", (None, KV, HEAD_DIM)),  # [R, K, E]: with the KV heads, or replicated
    (r"/attn/lora_wo_a$", (HEADS, HEAD_DIM, None)),  # [H, E, R]: its partial sums the base's all-reduce
    (r"/attn/lora_wo_b$", (None, EMBED)),  # [R, D]
    (r"/mlp/lora_w_(in|gate|up)_a$", (EMBED, None)),  # [D, R]
    (r"/mlp/lora_w_(in|gate|up)_b$", (None, MLP)),  # [R, F]
    (r"/mlp/lora_w_(out|down)_a$", (MLP, None)),  # [F, R]
    (r"/mlp/lora_w_(out|down)_b$", (None, EMBED)),  # [R, D]
)
# Logical dims -> mesh axes where no layout is given (``spec_for``'s default): mp's dims.
TENSOR_AXES = Layout().logical_axes()


def logical_dims(path: str, rules=RULES) -> tuple | None:
    """The first matching row's dims of ``path`` (``layers`` first for a stacked parameter); None when
    no row matches (``spec_for`` makes that an error)."""
    matched = next((dims for pattern, dims in rules if re.search(pattern, path)), None)
    if matched is None:
        return None
    return (LAYERS, *matched) if is_stacked(path) else tuple(matched)


def spec_for(path: str, shape: Sequence[int], mp: int, rules=RULES, kv_axis=MP, axes=None) -> P:
    """The PartitionSpec of one parameter, checking that the mesh divides every sharded dim. ``axes``:
    logical dim -> mesh axis (``Layout.logical_axes``; default mp's), with KV heads on ``kv_axis``; a
    row's mesh-axis names and None pass through."""
    names = logical_dims(path, rules)
    if names is None:
        raise ShardingError(
            f"no sharding rule matches parameter {path!r} {tuple(shape)}; "
            f"add a (regex, spec) row to the rules table"
        )
    axes = {**(TENSOR_AXES if axes is None else axes), KV: kv_axis}
    dims = tuple(axes.get(d) if d in LOGICAL_DIMS else d for d in names)
    if len(dims) != len(shape):
        raise ShardingError(
            f"rule for {path!r} has {len(dims)} dims but the parameter has shape {tuple(shape)}"
        )
    for i, (axis, size) in enumerate(zip(dims, shape, strict=True)):
        if axis == MP and size % mp:
            raise ShardingError(
                f"parameter {path!r} dimension {i} (size {size}) is not divisible by "
                f"mp={mp}; choose an mp that divides {size}"
            )
    return P(*dims)


def param_specs(params, mp: int, rules=RULES, kv_axis=MP, axes=None):
    """Map a Haiku params dict (arrays or ShapeDtypeStructs) to a dict of PartitionSpecs."""
    return {
        mod: {
            name: spec_for(param_path(mod, name), p.shape, mp, rules, kv_axis, axes)
            for name, p in leaves.items()
        }
        for mod, leaves in params.items()
    }


def fsdp_spec(path: str, shape: Sequence[int], spec: P, dp: int, fsdp_dim: str = EMBED, axis: str = DP) -> P:
    """``spec`` with ``axis`` (DP) added on the FSDP dimension of a weight (its logical ``fsdp_dim``: the
    model width, never a dimension MP uses; else its largest dimension MP does not use); norms and
    biases unchanged. Errors name a dimension dp cannot split."""
    if not (is_matmul_weight(path) or is_embedding(path) or is_table(path)):  # Gemma 4's per-layer table too
        return spec
    dims = list(spec) + [None] * (len(shape) - len(spec))
    offset = 1 if is_stacked(path) else 0
    names = logical_dims(path) or ()  # model_specs has matched every path already (spec_for)
    free = [i for i in range(offset, len(shape)) if dims[i] is None]
    dim = names.index(fsdp_dim) if fsdp_dim in names else max(free, key=lambda i: shape[i], default=None)
    if dim is None or dims[dim] is not None:
        raise ShardingError(f"parameter {path!r} {tuple(shape)} has no dimension free for --fsdp")
    if shape[dim] % dp:
        raise ShardingError(
            f"parameter {path!r} dimension {dim} (size {shape[dim]}) is not divisible by dp={dp} "
            f"under --fsdp; choose a dp that divides {shape[dim]}, or drop --fsdp"
        )
    dims[dim] = axis
    return P(*dims)


def model_specs(cfg, abstract_params, layout: Layout):
    """Specs for a meshlm model on ``layout``, resolving the KV placeholder for its config; with
    ``layout.fsdp`` every weight is also split over dp (``fsdp_spec``)."""
    from meshlm.model.attention import kv_replicated

    mp = layout.mp
    kv_axis = MP
    if cfg.arch.attention:
        if cfg.n_heads % mp:
            raise ShardingError(
                f"n_heads={cfg.n_heads} is not divisible by mp={mp}: the mesh cannot "
                f"split the attention heads; choose an mp that divides {cfg.n_heads}"
            )
        kv_axis = None if kv_replicated(cfg.kv_heads, mp) else MP
    if cfg.padded_vocab % mp:
        raise ShardingError(
            f"parameter 'embed/embeddings' dimension 0 (size {cfg.padded_vocab}) is not divisible by "
            f"mp={mp}: the padded vocabulary ({cfg.vocab_size} ids rounded up to a multiple of "
            f"vocab_multiple={cfg.vocab_multiple}); choose an mp that divides {cfg.padded_vocab}"
        )
    check_uniform_stack(cfg, layout)
    # With a pipeline the stacked ``layers`` dimension is split over PP (consecutive layers per stage:
    # the checkpoint format is unchanged); ``without_pp`` undoes it.
    own = f"{layer_kinds.GLOBAL_STACK}/" if getattr(cfg, "global_shape", False) else None  # Gemma 4's
    split = lambda mine: {m: leaves for m, leaves in abstract_params.items() if m.startswith(own) == mine}
    specs = param_specs(split(False) if own else abstract_params, mp, RULES, kv_axis, layout.logical_axes())
    if own:  # the global layers' own KV heads: split or replicated by their count
        specs |= param_specs(split(True), mp, RULES, _global_kv_axis(cfg, mp), layout.logical_axes())
    for mod in specs if layout.pipelined else ():  # a dense prefix: with the embedding, not over pp
        if mod.startswith(tuple(f"{name}/" for name in stage_layers.prefix_stacks(cfg))):
            specs[mod] = without_pp(specs[mod])
    for fsdp_dim in layout.option_axes():  # --fsdp: each weight's embed dim over dp (``_fsdp``)
        specs = {
            mod: {
                name: _fsdp(layout, param_path(mod, name), abstract_params[mod][name].shape, spec, fsdp_dim)
                for name, spec in leaves.items()
            }
            for mod, leaves in specs.items()
        }
    if layout.experts_split:
        check_experts_split(cfg, abstract_params, specs, layout.ep)
    return specs


def _global_kv_axis(cfg, mp: int):
    """The global layers' KV-head axis: MP where mp divides their KV heads, None (replicated) where
    they divide mp; a one-line error otherwise."""
    heads = cfg.global_view().kv_heads
    if heads % mp and mp % heads:
        raise ShardingError(
            f"global_kv_heads={heads} and mp={mp}: mp must divide the global layers' KV heads or be a "
            f"multiple of them; choose another mp"
        )
    return MP if heads % mp == 0 else None


def check_uniform_stack(cfg, layout: Layout) -> None:
    """The one refusal of --pp for a stack its stages cannot each run alike (``model.stage_layers``: a
    periodic stack of two layer kinds, or a MoE's dense prefix run with the embedding, passes): the
    rules table's and the pipeline's check (``pipelined.check_pipelined``) both ask here. A
    ShardingError, as for any split the mesh cannot make (``verify --matrix`` lists such cells as
    skipped). Gemma 4's stack carry is refused first, under --sp too (every layout asks here)."""
    if layout.pipelined and getattr(cfg, "per_layer", False):  # (Gemma 4: ``model.per_layer``)
        raise ShardingError(
            f"--pp: {cfg.family}'s layers carry keys and values and per-layer inputs from layer to layer, "
            "which the pipeline's stages do not pass on; drop --pp (use --mp, --fsdp)"
        )
    if layout.sp and getattr(cfg, "per_layer", False):
        raise ShardingError(
            f"--sp: {cfg.family}'s per-layer inputs are not split over the sequence; drop --sp"
        )
    if not layout.pipelined:
        return
    pipe = layout.pipeline
    chunks = pipe.pp * pipe.virtual_stages
    if len(layer_kinds.stacks(cfg)) == 1 and not cfg.global_every:  # one kind: equal chunks, or padded
        if not stage_layers.slots(cfg, chunks, pipe.virtual_stages):
            check_layers(pipe, cfg.n_layers)
        return
    problem = stage_layers.stage_problem(cfg, chunks, pipe.virtual_stages)
    if problem is not None:
        v = f" x {pipe.virtual_stages} virtual stages" if pipe.virtual_stages > 1 else ""
        works = stage_layers.working_pp(cfg, pipe.virtual_stages)
        fix = f"use --pp {' or '.join(map(str, works[:3]))}" if works else "drop --pp"
        raise ShardingError(
            f"--pp {pipe.pp}{v}: {problem}, and pipeline stages each run the same layers "
            f"(a chunk whole periods of the kinds, a dense prefix with the embedding); {fix}"
        )
    if (
        stage_layers.prefix(cfg) and layout.context_parallel
    ):  # the embedding runs under a cond: no ring inside
        raise ShardingError(
            f"--pp with --cp: {cfg.family}'s dense prefix runs with the embedding on the first stage, "
            "where context parallelism's ring cannot run; drop --cp or --pp"
        )


def _fsdp(layout: Layout, path: str, shape, spec: P, fsdp_dim: str) -> P:
    """``fsdp_spec`` of one parameter on ``layout``, over ``Layout.fsdp_axes`` (FSDP's one decision):
    with ep on, a dense weight over every data shard (dp, ep) -- ``layout.dp`` shards --, an expert
    weight (its experts already split over EP) over the data shards outside ep, the mesh's DP axis
    (dp / ep: with dp = ep none, and it stays whole on its ep shard)."""
    expert = EP in spec_axes(spec)
    shards = layout.fsdp_shards(expert)
    if expert and shards == 1:
        return spec
    return fsdp_spec(path, shape, spec, shards, fsdp_dim, layout.fsdp_axes(expert))


def check_experts_split(cfg, abstract_params, specs, ep: int) -> None:
    """With --ep every expert dimension must divide over ep, and the model must have experts."""
    split = 0
    for mod, leaves in specs.items():
        for name, spec in leaves.items():
            shape = abstract_params[mod][name].shape
            for i, axis in enumerate(spec):
                if axis != EP:
                    continue
                split += 1
                if shape[i] % ep:
                    raise ShardingError(
                        f"parameter {param_path(mod, name)!r} dimension {i} ({shape[i]} experts) is not "
                        f"divisible by ep={ep}; choose an --ep that divides {shape[i]}"
                    )
    if not split:
        family = getattr(cfg, "family", "this model")
        raise ConfigError(f"--ep {ep} splits the experts, but {family} has none (no MoE layer); drop --ep")


def without_pp(specs):
    """``specs`` with PP removed (the layer dimension unsplit): what the pipeline places within a stage."""
    strip = lambda s: P(*(None if d == PP else d for d in s))
    return jax.tree.map(strip, specs, is_leaf=lambda x: isinstance(x, P))


def spec_axes(spec: P) -> set[str]:
    """The mesh axes a parameter is stored split over."""
    return {a for d in spec for a in (d if isinstance(d, tuple) else (d,)) if a is not None}


def dp_sharded(spec: P) -> bool:
    """Whether a parameter is stored split over DP (FSDP)."""
    return DP in spec_axes(spec)


def shardings(specs, mesh):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def init_sharded(init_fn, rng, *example_args, specs_fn, mesh, dtype=None, pad=None):
    """Create parameters already sharded: eval_shape -> specs -> jit(init, out_shardings=...).

    ``init_fn`` is a Haiku ``transform(...).init``; ``specs_fn(abstract_params) -> specs``. The values
    do not depend on the mesh (JAX's partitionable threefry), so any mesh gives the one-device bits.
    ``pad``: the canonical tree -> the device layout (uneven pp stages' padded stack,
    ``stage_slots.Slots.pad``), in the same program.
    """
    abstract = jax.eval_shape(init_fn, rng, *example_args)
    specs = specs_fn(abstract)
    out, tree = jax.tree.flatten(shardings(specs, mesh))
    return _init_program(init_fn, tuple(out), tree, dtype, pad)(rng, *example_args), specs


@functools.lru_cache(maxsize=32)
def _init_program(init_fn, out: tuple, tree, dtype, pad):
    """The jitted init of ``init_fn`` onto the shardings ``out`` (flat, ``tree``'s): one per model config
    (``transformer.init_fn`` gives a config one function), mesh and dtype, so an init after the first is
    one call of a compiled program, not a trace, lowering and compile (a tiny model's: 0.25-1.5 s CPU)."""
    traced = jax.jit(init_fn)  # the program eval_shape traced: the Haiku forward is traced once, not twice

    def init(rng, *args):
        params = traced(rng, *args)
        params = params if pad is None else pad(params)
        return params if dtype is None else jax.tree.map(lambda p: p.astype(dtype), params)

    return jax.jit(init, out_shardings=jax.tree.unflatten(tree, out))
