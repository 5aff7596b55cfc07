"""Parameter sharding: one ordered table from parameter path to PartitionSpec, first match wins.

Specs are written for a parameter's own dimensions; parameters stacked by ``layer_stack`` (paths
starting with ``layers/``) get a leading replicated layer dimension. A parameter no rule matches, or
a sharded dimension the mesh does not divide, is an error naming both: nothing is quietly replicated.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshlm.errors import ShardingError
from meshlm.model.params import is_embedding, is_matmul_weight, is_stacked, param_path
from meshlm.parallel.axes import DP, MP, PP
from meshlm.parallel.layout import Layout

KV = "kv_heads"  # placeholder: MP when mp divides the KV heads, replicated when they are repeated

# (regex on "module/param", spec of the parameter's own dims). Global shapes in the comments.
RULES: tuple[tuple[str, tuple], ...] = (
    (r"^embed/embeddings$", (MP, None)),  # [V, D]: contiguous vocab slices
    (r"^embed/b$", (None,)),  # [D]: added once after the all-reduce
    (r"^head/w$", (None, MP)),  # [D, V]
    (r"^head/b$", (MP,)),  # [V]
    (r"/attn/wq$", (None, MP, None)),  # [D, H, E]: by heads
    (r"/attn/w[kv]$", (None, KV, None)),  # [D, K, E]: by KV heads, or replicated when mp > K
    (r"/attn/wo$", (MP, None, None)),  # [H, E, D]: row-parallel
    (r"/attn/bq$", (MP, None)),  # [H, E]: Qwen2's q bias, sliced with its heads
    (r"/attn/b[kv]$", (KV, None)),  # [K, E]: with the KV heads, or replicated when mp > K
    (r"/attn/[qk]_norm/scale$", (None,)),  # [E]: Qwen3's per-head q/k norm, shared by every head
    (r"/attn/q_norm/scale_heads$", (MP, None)),  # [H, E]: OLMo 2's q norm over H*E, with its heads
    (r"/attn/k_norm/scale_heads$", (KV, None)),  # [K, E]: OLMo 2's k norm, with the KV heads
    (r"/mlp/w_(in|gate|up)$", (None, MP)),  # [D, F]: column-parallel
    (r"/mlp/b_in$", (MP,)),  # [F]
    (r"/mlp/w_(out|down)$", (MP, None)),  # [F, D]: row-parallel
    (r"/mlp/b_out$", (None,)),  # [D]: added once after the all-reduce
    (r"(^|/)(ln|ln2|final_ln|post_attn_ln|post_mlp_ln)/(scale|offset)$", (None,)),  # [D]: replicated
)

# FSDP (``--fsdp``): the dimension of each weight's own dims that is additionally split over DP (the
# model width D everywhere: never a dimension MP uses). A weight no row names takes its largest
# dimension MP does not use; norms and biases stay replicated over DP. Global shapes in the comments.
FSDP_RULES: tuple[tuple[str, int], ...] = (
    (r"^embed/embeddings$", 1),  # [V, D]
    (r"^head/w$", 0),  # [D, V]
    (r"/attn/w[qkv]$", 0),  # [D, H, E] / [D, K, E]
    (r"/attn/wo$", 2),  # [H, E, D]
    (r"/mlp/w_(in|gate|up)$", 0),  # [D, F]
    (r"/mlp/w_(out|down)$", 1),  # [F, D]
)


def spec_for(path: str, shape: Sequence[int], mp: int, rules=RULES, kv_axis=MP) -> P:
    """The PartitionSpec of one parameter, checking that the mesh divides every sharded dim."""
    matched = [dims for pattern, dims in rules if re.search(pattern, path)]
    if not matched:
        raise ShardingError(
            f"no sharding rule matches parameter {path!r} {tuple(shape)}; "
            f"add a (regex, spec) row to the rules table"
        )
    dims = tuple(kv_axis if d == KV else d for d in matched[0])  # first match wins
    if is_stacked(path):
        dims = (None, *dims)
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


def param_specs(params, mp: int, rules=RULES, kv_axis=MP):
    """Map a Haiku params dict (arrays or ShapeDtypeStructs) to a dict of PartitionSpecs."""
    return {
        mod: {
            name: spec_for(param_path(mod, name), p.shape, mp, rules, kv_axis) for name, p in leaves.items()
        }
        for mod, leaves in params.items()
    }


def fsdp_spec(path: str, shape: Sequence[int], spec: P, dp: int) -> P:
    """``spec`` with DP added on the FSDP dimension of a weight (``FSDP_RULES``, else its largest
    dimension MP does not use); norms and biases unchanged. Errors name a dimension dp cannot split."""
    if not (is_matmul_weight(path) or is_embedding(path)):
        return spec
    dims = list(spec) + [None] * (len(shape) - len(spec))
    offset = 1 if is_stacked(path) else 0
    named = [d for pattern, d in FSDP_RULES if re.search(pattern, path)]
    free = [i for i in range(offset, len(shape)) if dims[i] is None]
    dim = named[0] + offset if named else max(free, key=lambda i: shape[i], default=None)
    if dim is None or dims[dim] is not None:
        raise ShardingError(f"parameter {path!r} {tuple(shape)} has no dimension free for --fsdp")
    if shape[dim] % dp:
        raise ShardingError(
            f"parameter {path!r} dimension {dim} (size {shape[dim]}) is not divisible by dp={dp} "
            f"under --fsdp; choose a dp that divides {shape[dim]}, or drop --fsdp"
        )
    dims[dim] = DP
    return P(*dims)


def model_specs(cfg, abstract_params, layout: Layout):
    """Specs for a meshlm model on ``layout``, resolving the KV placeholder for its config; with
    ``layout.fsdp`` every weight is also split over dp (``fsdp_spec``)."""
    from meshlm.model.attention import kv_replicated

    mp, dp = layout.mp, layout.dp
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
    specs = param_specs(abstract_params, mp, RULES, kv_axis)
    if layout.fsdp:
        specs = {
            mod: {
                name: fsdp_spec(param_path(mod, name), abstract_params[mod][name].shape, spec, dp)
                for name, spec in leaves.items()
            }
            for mod, leaves in specs.items()
        }
    return pp_specs(specs, layout)


def pp_specs(specs, layout: Layout):
    """With ``layout.pp > 1`` the stacked layer dimension of ``layers/`` parameters is split over PP
    (consecutive layers per stage: the checkpoint format is unchanged); ``layer_specs`` undoes it."""
    if layout.pp == 1:
        return specs
    return {
        mod: {
            name: P(PP, *spec[1:]) if is_stacked(param_path(mod, name)) else spec
            for name, spec in leaves.items()
        }
        for mod, leaves in specs.items()
    }


def without_pp(specs):
    """``specs`` with PP removed (the layer dimension unsplit): what the pipeline places within a stage."""
    strip = lambda s: P(*(None if d == PP else d for d in s))
    return jax.tree.map(strip, specs, is_leaf=lambda x: isinstance(x, P))


def dp_sharded(spec: P) -> bool:
    """Whether a parameter is stored split over DP (FSDP)."""
    return any(d == DP or (isinstance(d, tuple) and DP in d) for d in spec)


def shardings(specs, mesh):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def init_sharded(init_fn, rng, *example_args, specs_fn, mesh, dtype=None):
    """Create parameters already sharded: eval_shape -> specs -> jit(init, out_shardings=...).

    ``init_fn`` is a Haiku ``transform(...).init``; ``specs_fn(abstract_params) -> specs``. The values
    do not depend on the mesh (JAX's partitionable threefry), so any mesh gives the one-device bits.
    """
    abstract = jax.eval_shape(init_fn, rng, *example_args)
    specs = specs_fn(abstract)

    def init(rng, *args):
        params = init_fn(rng, *args)
        return params if dtype is None else jax.tree.map(lambda p: p.astype(dtype), params)

    params = jax.jit(init, out_shardings=shardings(specs, mesh))(rng, *example_args)
    return params, specs
