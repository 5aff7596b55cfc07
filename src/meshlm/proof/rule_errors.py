"""A sharding rule that gives a parameter the wrong per-shard shape, reported as a failing proof row.

Inside ``shard_map`` each layer requests its parameters in their per-shard shape; Haiku refuses a
provided parameter of another shape. That happens when the rules table splits a parameter along a
dimension the layer does not (or not at all). The proof turns Haiku's error into a row naming the
parameter, its spec and both shapes, instead of a traceback.
"""

from __future__ import annotations

import re

from meshlm.model.params import flat_params
from meshlm.proof.report import LeafResult

_HAIKU_SHAPE = re.compile(r"'([^']+)' with retrieved shape (\([^)]*\)) does not match shape=(\[[^\]]*\])")


def rule_mismatch(error: BaseException, params, specs) -> tuple[LeafResult, str] | None:
    """(failing row, explanation) if ``error`` is Haiku's per-shard shape mismatch, else None."""
    m = _HAIKU_SHAPE.search(str(error)) if isinstance(error, ValueError) else None
    if m is None:
        return None
    shapes, spec = flat_params(params), flat_params(specs)
    path = _full_path(m.group(1).replace("/~/", "/"), shapes)
    shape = tuple(shapes[path].shape) if path in shapes else ()
    given, wanted = m.group(2), "(" + m.group(3).strip("[]") + ")"
    row = LeafResult(path=path, shape=shape, spec=str(spec.get(path, "?")), ok=False)
    row.max_abs_err = row.max_rel_err = float("inf")
    detail = (
        f"{path} {shape}: its rule gives {row.spec}, so each shard holds {given}, but the layer "
        f"computes with {wanted} per shard; fix the rule for this parameter"
    )
    return row, detail


def _full_path(name: str, shapes: dict) -> str:
    """Haiku names a parameter of a stacked layer by its path inside the stack (``mlp/w_gate``); the
    table knows it as ``layers/mlp/w_gate``."""
    if name in shapes:
        return name
    matches = [p for p in shapes if p.endswith("/" + name)]
    return matches[0] if len(matches) == 1 else name
