"""A mixture of experts' two kinds of layer (``ModelConfig.dense_layers``): which layers are dense, and
the runs of consecutive same-kind layers the stack runs one scan each (``model.stack``).

This module must not import JAX: configs are validated before devices exist.
"""

from __future__ import annotations

from typing import Any

from meshlm.errors import ConfigError

# The parameters of the MoE layers (or every layer of a homogeneous model) stack under "layers"; the
# dense layers' among them under "dense_layers" (``model.params.STACKS``), each [count, ...].
MOE_STACK, DENSE_STACK = "layers", "dense_layers"


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


def stacks(cfg) -> dict[str, tuple[int, ...]]:
    """Each parameter stack's module name -> the model's layer indices it holds, in order: "layers"
    every layer of a homogeneous model (a mixture of experts without dense layers: as before), else
    the MoE layers, and "dense_layers" the dense ones."""
    if not cfg.dense_layers:
        return {MOE_STACK: tuple(range(cfg.n_layers))}
    return {MOE_STACK: cfg.moe_layers, DENSE_STACK: cfg.dense_layers}


def runs(cfg) -> list[tuple[str, int, int, int]]:
    """The stack as runs of consecutive same-kind layers: (stack name, first layer, start, stop) with
    [start, stop) the run's slice of that stack's parameters."""
    out: list[tuple[str, int, int, int]] = []
    seen = {MOE_STACK: 0, DENSE_STACK: 0}
    for i in range(cfg.n_layers):
        name = DENSE_STACK if i in cfg.dense_layers else MOE_STACK
        if out and out[-1][0] == name:
            out[-1] = (*out[-1][:3], out[-1][3] + 1)
        else:
            out.append((name, i, seen[name], seen[name] + 1))
        seen[name] += 1
    return out
