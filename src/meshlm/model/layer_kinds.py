"""Layers of two kinds whose parameters differ: a mixture of experts' dense layers
(``ModelConfig.dense_layers``), a hybrid's linear-attention layers among its full-attention ones
(``LinearAttentionFields``: Qwen3.5's Gated DeltaNet, ``model.linear_attention``), or global layers
of their own attention shape (``PerLayerFields.global_shape``: Gemma 4's); which layer is of
which kind, and the runs of consecutive same-kind layers the stack runs one scan each (``model.stack``).

This module must not import JAX: configs are validated before devices exist.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshlm.errors import ConfigError
from meshlm.ranges import POSITIVE_INT, Range

# The parameters of the MoE layers (or every layer of a homogeneous model, or a hybrid's full-attention
# layers) stack under "layers"; the dense layers' among MoE ones under "dense_layers", a hybrid's
# linear-attention layers' under "linear_layers", global layers of another attention shape under
# "global_layers" (the local ones under "layers"; ``model.params``), each [count, ...].
MOE_STACK, DENSE_STACK, LINEAR_STACK = "layers", "dense_layers", "linear_layers"
GLOBAL_STACK = "global_layers"


@dataclass(frozen=True)
class LinearAttentionFields:
    """``ModelConfig``'s linear-attention fields (Qwen3.5's Gated DeltaNet; a base, as ``MoEFields``).

    Layer i is full attention if (i + 1) % ``full_attn_every`` == 0, else a linear-attention layer
    (transformers' ``full_attention_interval`` / ``layer_types``); 0: no linear layers (as before, and
    what a saved config without these fields loads as). A linear layer has ``linear_key_heads`` key
    heads of ``linear_key_dim`` and ``linear_value_heads`` (a multiple: each key head serves
    consecutive value heads) of ``linear_value_dim``, a causal depthwise conv of ``linear_conv`` taps,
    and runs the delta rule in chunks of ``linear_chunk`` tokens (``model.deltanet``)."""

    full_attn_every: int = 0
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    linear_conv: int = 4
    linear_chunk: int = 64

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """The indices of the linear-attention layers (none without ``full_attn_every``)."""
        every = self.full_attn_every
        return tuple(i for i in range(self.n_layers) if (i + 1) % every) if every else ()


LINEAR_RANGES = {
    "full_attn_every": Range(int, 0, note="0: no linear-attention layers"),
    **dict.fromkeys(("linear_key_heads", "linear_value_heads", "linear_key_dim"), Range(int, 0)),
    "linear_value_dim": Range(int, 0),
    "linear_conv": POSITIVE_INT,
    "linear_chunk": POSITIVE_INT,
}


def check_linear(cfg) -> None:
    """The linear-attention fields agree: sized where the model has linear layers, value heads a
    multiple of key heads, and no mixture of experts' dense layers beside them (one second kind)."""
    if not cfg.full_attn_every:
        return
    kh, vh = cfg.linear_key_heads, cfg.linear_value_heads
    if not (cfg.arch.attention and kh and vh and cfg.linear_key_dim and cfg.linear_value_dim):
        raise ConfigError(
            f"full_attn_every={cfg.full_attn_every} needs a family with attention and linear_key_heads, "
            "linear_value_heads, linear_key_dim, linear_value_dim >= 1; set them, or full_attn_every=0"
        )
    if vh % kh:
        raise ConfigError(f"linear_value_heads={vh} must be a multiple of linear_key_heads={kh}")
    if cfg.dense_layers:
        raise ConfigError("dense_layers and full_attn_every together are not supported; set dense_layers=[]")


def layer_indices(name: str, value: Any) -> tuple[int, ...]:
    """``value`` (layer indices: JSON gives a list) as a sorted tuple of distinct ints >= 0, or a
    one-line ConfigError naming the field."""
    ok = isinstance(value, (list, tuple)) and all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value
    )
    if not ok or len(set(value)) != len(value):
        raise ConfigError(f"{name} must be a list of distinct layer indices >= 0, got {value!r}")
    return tuple(sorted(int(i) for i in value))


def check_dense_layers(cfg) -> None:
    """The dense layers of a mixture of experts are layers of the model, and not all of them."""
    dense = cfg.dense_layers
    if dense and dense[-1] >= cfg.n_layers:
        raise ConfigError(
            f"dense_layers={list(dense)} names layers beyond n_layers={cfg.n_layers}; "
            f"use indices 0..{cfg.n_layers - 1}"
        )
    if len(dense) == cfg.n_layers:
        raise ConfigError(
            f"dense_layers={list(dense)} makes every layer dense; keep one MoE layer or use a dense "
            "family (qwen2, mistral)"
        )


def _other(cfg) -> tuple[str, tuple[int, ...]] | None:
    """The second kind's stack name and layer indices, or None: every layer alike."""
    if cfg.dense_layers:
        return DENSE_STACK, cfg.dense_layers
    if getattr(cfg, "full_attn_every", 0) and cfg.linear_layers:
        return LINEAR_STACK, cfg.linear_layers
    if getattr(cfg, "global_shape", False):
        return GLOBAL_STACK, tuple(i for i in range(cfg.n_layers) if (i + 1) % cfg.global_every == 0)
    return None


def stacks(cfg) -> dict[str, tuple[int, ...]]:
    """Each parameter stack's module name -> the model's layer indices it holds, in order: "layers"
    every layer of a homogeneous model (a mixture of experts without dense layers: as before), else
    the layers of the first kind (MoE, or full attention), and the second kind's stack the others."""
    other = _other(cfg)
    if other is None:
        return {MOE_STACK: tuple(range(cfg.n_layers))}
    first = tuple(i for i in range(cfg.n_layers) if i not in other[1])
    return {MOE_STACK: first, other[0]: other[1]} if first else {other[0]: other[1]}


def runs(cfg) -> list[tuple[str, int, int, int]]:
    """The stack as runs of consecutive same-kind layers: (stack name, first layer, start, stop) with
    [start, stop) the run's slice of that stack's parameters."""
    out: list[tuple[str, int, int, int]] = []
    seen = dict.fromkeys((MOE_STACK, DENSE_STACK, LINEAR_STACK, GLOBAL_STACK), 0)
    other = _other(cfg) or ("", ())
    for i in range(cfg.n_layers):
        name = other[0] if i in other[1] else MOE_STACK
        if out and out[-1][0] == name:
            out[-1] = (*out[-1][:3], out[-1][3] + 1)
        else:
            out.append((name, i, seen[name], seen[name] + 1))
        seen[name] += 1
    return out


@dataclass(frozen=True)
class LayerKindFields:
    """``ModelConfig``'s per-layer attention kinds (Gemma 2/3; a base, as ``MoEFields``)."""

    # ``attention.kind_tables``; absent from a saved config: 0, as it was: scores / sqrt(attn_scalar or
    # head_dim); layer i global (rope_theta, rope_scaling or rope_linear: positions / factor) if (i + 1)
    # % global_every == 0, else local (sliding_window, plain RoPE of rope_local_theta); 0: layers alike.
    attn_scalar: float = 0.0
    global_every: int = 0
    rope_local_theta: float = 0.0
    rope_linear: float = 0.0
