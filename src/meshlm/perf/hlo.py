"""Count the collectives in a compiled XLA program, to check what a sharding really costs.

The count is static: an op inside a loop body (e.g. a scan over layers) counts once, however
many times the loop runs. Only instructions are counted, never computation or operand names, so
``%all-reduce.3 = f32[8] all-reduce(%x), to_apply=%add`` is one all-reduce.
"""

from __future__ import annotations

import re
from typing import Any

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

# `[ROOT] %name = ` at the start of an instruction line; the `%` is optional in newer printers.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*")
_OPCODE = re.compile(r"\s*([\w\-]+)\(")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_BITS = re.compile(r"^[a-z]+?(\d+)")


def collectives_from_text(hlo_text: str) -> dict[str, dict[str, int]]:
    """Per collective kind, the number of ops and the total bytes of their results.

    Async pairs count once: ``X-start`` adds to the count and ``X-done`` adds the bytes, because
    the start's result is a wrapper tuple that also holds the operand (and, for
    collective-permute, sync flags) while the done's result is exactly the collective's result.
    """
    out = {name: {"count": 0, "bytes": 0} for name in COLLECTIVES}
    for line in hlo_text.splitlines():
        parsed = _parse_instruction(line)
        if parsed is None:
            continue
        opcode, result_type = parsed
        base, phase = _split_async(opcode)
        if base not in out:
            continue
        if phase in ("", "start"):
            out[base]["count"] += 1
        if phase in ("", "done"):
            out[base]["bytes"] += shape_bytes(result_type)
    return out


def collectives_of(compiled: Any) -> dict[str, dict[str, int]]:
    """`collectives_from_text` of a ``jax.stages.Compiled`` (``jit(f).lower(...).compile()``)."""
    text = compiled.as_text()
    if not isinstance(text, str):
        # Some backends cannot print their executable; counting nothing would be a silent lie.
        raise ValueError(f"{type(compiled).__name__}.as_text() returned no HLO text")
    return collectives_from_text(text)


def shape_bytes(type_text: str) -> int:
    """Total bytes of an HLO shape such as ``f32[8,16]{1,0}`` or ``(bf16[4], s32[])``."""
    total = 0
    for dtype, dims in _ARRAY.findall(type_text):
        elements = 1
        for dim in filter(None, (d.strip() for d in dims.split(","))):
            # Dynamic dimensions print as `<=8`: the buffer is sized for the bound.
            elements *= int(dim.removeprefix("<="))
        total += (elements * _dtype_bits(dtype) + 7) // 8
    return total


def _dtype_bits(dtype: str) -> int:
    """Bits per element: the width is the first number in every XLA dtype name but these."""
    if dtype == "pred":
        return 8
    if dtype == "token":
        return 0
    match = _BITS.match(dtype)
    if match is None:
        raise ValueError(f"unknown HLO element type {dtype!r}")
    return int(match.group(1))


def _split_async(opcode: str) -> tuple[str, str]:
    """``all-gather-start`` -> (``all-gather``, ``start``); a synchronous op has phase ``""``."""
    for phase in ("start", "done"):
        if opcode.endswith("-" + phase):
            return opcode.removesuffix("-" + phase), phase
    return opcode, ""


def _parse_instruction(line: str) -> tuple[str, str] | None:
    """(opcode, result type text) of an HLO instruction line, or None for any other line."""
    head = _INSTRUCTION.match(line)
    if head is None:
        return None
    start = head.end()
    end = _type_end(line, start)
    if end is None:
        return None
    opcode = _OPCODE.match(line, end)
    if opcode is None:
        return None
    return opcode.group(1), line[start:end]


def _type_end(line: str, start: int) -> int | None:
    """Index just past the shape starting at ``start``: a balanced tuple or array + layout."""
    if line.startswith("(", start):
        depth = 0
        for i in range(start, len(line)):
            depth += {"(": 1, ")": -1}.get(line[i], 0)
            if depth == 0:
                return i + 1
        return None
    array = _ARRAY.match(line, start)
    if array is None:
        return None
    end = array.end()
    if line.startswith("{", end):
        # Layouts may hold tiling parens, `{1,0:T(8,128)}`, but never nested braces.
        close = line.find("}", end)
        return None if close < 0 else close + 1
    return end
