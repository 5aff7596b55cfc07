"""Errors raised while tracing the sharded program, reported as failing proof rows, not tracebacks.

* A sharding rule that gives a parameter the wrong per-shard shape: inside ``shard_map`` each layer
  requests its parameters in their per-shard shape and Haiku refuses a provided parameter of another
  shape (the rules table splits a parameter along a dimension the layer does not, or not at all). The
  row names the parameter, its spec and both shapes.
* JAX's varying-axis type check (``shard_map(check_vma=True)``) rejecting the sharded program: a
  value per-shard over a mesh axis where the program needs it replicated, or the reverse. The row
  names where (the collective or layer in meshlm's code, or the output: the loss or a parameter's
  gradient with its rule) and the typing rule that was broken.
"""

from __future__ import annotations

import re
import traceback
from pathlib import Path

from meshlm.model.params import flat_params
from meshlm.proof.report import LeafResult

_HAIKU_SHAPE = re.compile(r"'([^']+)' with retrieved shape (\([^)]*\)) does not match shape=(\[[^\]]*\])")

# What JAX's varying-axis type check says when it rejects a program (JAX 0.10), and the rule each
# wording means: a primitive whose operands disagree on varying axes, outputs whose replication
# out_specs demand cannot be inferred, a cast a value's varying type does not allow (e.g. ``f``
# applied to an already per-shard value), a custom VJP whose gradient varies where its input did not.
VMA_RULES = {
    "requires varying manual axes": "the operands of one operation must vary over the same mesh axes: a "
    "per-shard value met a replicated one with no f (pcast) or g (psum) between them",
    "out_specs which require replication": "an output declared replicated (out_specs P()) varies over a "
    "mesh axis: the all-reduce (g, or the data-parallel mean) that makes it replicated is missing",
    "Unsupported pcast from=": "f (pcast to per-shard) was applied to a value that is per-shard already: "
    "the all-reduce (g / row_out) that should have made it replicated before is missing",
    "the manual axis types do not match": "a custom VJP's gradient must vary over the mesh axes its "
    "input does: a per-shard gradient reached a replicated input (a missing f before the layer)",
}
VMA_REJECTIONS = tuple(VMA_RULES)


def is_vma_rejection(e: BaseException) -> bool:
    return isinstance(e, ValueError) and any(s in str(e) for s in VMA_REJECTIONS)


def rule_mismatch(error: BaseException, params, specs) -> tuple[LeafResult, str] | None:
    """(failing row, explanation) if ``error`` is Haiku's per-shard shape mismatch, else None."""
    m = _HAIKU_SHAPE.search(str(error)) if isinstance(error, ValueError) else None
    if m is None:
        return None
    shapes, spec = flat_params(params), flat_params(specs)
    path = _full_path(m.group(1).replace("/~/", "/"), shapes)
    shape = tuple(shapes[path].shape) if path in shapes else ()
    given, wanted = m.group(2), "(" + m.group(3).strip("[]") + ")"
    row = _failing_row(path, shape, str(spec.get(path, "?")))
    detail = (
        f"{path} {shape}: its rule gives {row.spec}, so each shard holds {given}, but the layer "
        f"computes with {wanted} per shard; fix the rule for this parameter"
    )
    return row, detail


def vma_error(error: BaseException, params, specs) -> tuple[LeafResult, str] | None:
    """(failing row, explanation) if ``error`` is JAX's varying-axis type error, else None."""
    if not is_vma_rejection(error):
        return None
    text = str(error)
    rule = next(r for wording, r in VMA_RULES.items() if wording in text)
    lines = [line for line in text.strip().splitlines() if line.strip()]
    output = re.search(r"out_specs((?:\[[^\]]+\])+) is", text)
    first = next((line for line in lines if line.startswith("out_specs[")), lines[0])
    if output:
        path, shape, spec = _output(output.group(1), params, specs)
        where = "the loss (out_specs P())" if path == "loss" else f"the gradient of {path} (its rule {spec})"
    else:
        path, shape, spec = "varying-axis types", (), "?"
        where = _where(error)
    detail = f"JAX's check_vma rejected the sharded program at {where}: {first} -- rule: {rule}"
    return _failing_row(path, shape, spec), detail


def _output(index: str, params, specs) -> tuple[str, tuple, str]:
    """(path, shape, spec) of the shard_map output ``out_specs[0]`` (the loss) or ``[1][m][n]``."""
    keys = re.findall(r"\[([^\]]+)\]", index)
    if keys[:1] == ["0"] or len(keys) < 3:
        return "loss", (), "P()"
    path = f"{keys[-2].strip(chr(39))}/{keys[-1].strip(chr(39))}".replace("/~/", "/")
    shapes, spec = flat_params(params), flat_params(specs)
    return path, tuple(getattr(shapes.get(path), "shape", ())), str(spec.get(path, "?"))


def _where(error: BaseException) -> str:
    """The innermost frames in meshlm's own code (a collective in ``parallel``, the layer calling it)."""
    frames = [
        f
        for f in traceback.extract_tb(error.__traceback__)
        if "/meshlm/" in f.filename and "/meshlm/proof/" not in f.filename
    ]
    if not frames and "Custom VJP" in str(error):
        return "a custom VJP's backward (meshlm's one: the weight matmul of model/dense.py)"
    if not frames:
        return "an operation outside meshlm's code"
    name = lambda f: f"{f.name} ({Path(f.filename).parent.name}/{Path(f.filename).name}:{f.lineno})"
    return " called from ".join(name(f) for f in reversed(frames[-2:]))


def _failing_row(path: str, shape: tuple, spec: str) -> LeafResult:
    row = LeafResult(path=path, shape=shape, spec=spec, ok=False)
    row.max_abs_err = row.max_rel_err = row.tol_ratio = float("inf")
    return row


def _full_path(name: str, shapes: dict) -> str:
    """Haiku names a parameter of a stacked layer by its path inside the stack (``mlp/w_gate``); the
    table knows it as ``layers/mlp/w_gate``."""
    if name in shapes:
        return name
    matches = [p for p in shapes if p.endswith("/" + name)]
    return matches[0] if len(matches) == 1 else name
