"""Count the collectives in a compiled XLA program, to check what a sharding really costs.

Two counts. ``collectives_from_text`` / ``collectives_of`` are static: an op inside a loop body
(e.g. a scan over layers) counts once, however many times the loop runs. ``collectives_per_step``
counts what one execution runs: loop bodies times their known trip count, called computations
followed, and no-op collectives (replica groups of one device) set aside. Only instructions are
counted, never computation or operand names, so ``%all-reduce.3 = f32[8] all-reduce(%x),
to_apply=%add`` is one all-reduce.
"""

from __future__ import annotations

import math
import re
from typing import Any

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

# `[ROOT] %name = ` at the start of an instruction line; the `%` is optional in newer printers.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*")
_OPCODE = re.compile(r"\s*([\w\-]+)\(")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_BITS = re.compile(r"^[a-z]+?(\d+)")
# Per step: computation headers, what an instruction calls, how many devices take part.
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_BODY = re.compile(r"\bbody=%?([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLS = re.compile(r"\b(?:calls|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([^}]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[\d+,(\d+)\]")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")


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


# --- per step: loops times their trip counts ------------------------------------------------------


def collectives_per_step(hlo_text: str) -> dict[str, Any]:
    """Collectives one execution runs: loop bodies times their known trip count (the static count
    takes each op once), leaving out trivial ones whose replica groups have one device (no-ops) but
    counting them under ``trivial``. Per kind {"count", "bytes"} (result bytes, as statically)."""
    comps, entry = _computations(hlo_text)
    memo: dict[str, tuple[dict, int]] = {}

    def total(name: str) -> tuple[dict, int]:
        if name not in memo:
            lines = comps.get(name, [])
            real = [ln for ln in lines if group_size(ln) != 1]
            counts, trivial = collectives_from_text("\n".join(real)), len(lines) - len(real)
            for line in lines:
                for callee, times in _callees(line):
                    sub, sub_trivial = total(callee)
                    trivial += times * sub_trivial
                    for kind in COLLECTIVES:
                        for key in ("count", "bytes"):
                            counts[kind][key] += times * sub[kind][key]
            memo[name] = (counts, trivial)
        return memo[name]

    counts, trivial = total(entry)
    return {**counts, "trivial": trivial}


def ops_per_step(hlo_text: str, opcode: str) -> int:
    """Instructions ``opcode`` (e.g. ``dot``) one execution runs: loop bodies times their known trip
    count, called and fused computations followed (so a dot XLA fused into a kernel still counts)."""
    comps, entry = _computations(hlo_text)
    memo: dict[str, int] = {}

    def total(name: str) -> int:
        if name not in memo:
            memo[name] = 0  # a computation never calls itself; this guards the recursion anyway
            count = 0
            for line in comps.get(name, []):
                parsed = _parse_instruction(line)
                count += parsed is not None and parsed[0] == opcode
                count += sum(times * total(callee) for callee, times in _callees(line))
            memo[name] = count
        return memo[name]

    return total(entry)


def group_size(line: str) -> int | None:
    """Participants per replica group of a collective instruction line; None if not printed."""
    if m := _GROUPS_LIST.search(line):
        return len([x for x in m.group(1).split(",") if x.strip()])
    if m := _GROUPS_IOTA.search(line):
        return int(m.group(1))
    if m := _GROUPS_MESH.search(line):
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
        return math.prod(int(sizes.get(a, 1)) for a in re.findall(r"'(\w+)'", m.group(2)))
    return None


def _computations(hlo_text: str) -> tuple[dict[str, list[str]], str]:
    """{computation name: its instruction lines} and the entry computation's name."""
    comps: dict[str, list[str]] = {}
    entry, current = "", None
    for line in hlo_text.splitlines():
        if current is None and (m := _HEADER.match(line)):
            current = m.group(2)
            comps[current] = []
            entry = current if m.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif current is not None:
            comps[current].append(line)
    return comps, entry


def _callees(line: str) -> list[tuple[str, int]]:
    """(computation, times it runs) called by one instruction; while bodies run their trip count."""
    parsed = _parse_instruction(line)
    if parsed is not None and parsed[0] == "while" and (body := _BODY.search(line)):
        trip = _TRIP.search(line)
        return [(body.group(1), int(trip.group(1)) if trip else 1)]
    out = [(name, 1) for name in _CALLS.findall(line)]
    if m := _BRANCHES.search(line):
        out += [(b.strip().lstrip("%"), 1) for b in m.group(1).split(",") if b.strip()]
    return out


# --- parsing one instruction -----------------------------------------------------------------------


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


_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")
_DOT_OPERANDS = re.compile(r"\bdot\(\s*%?([\w.\-]+)")
_LHS_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")


def dot_flops_per_step(hlo_text: str) -> float:
    """Matmul FLOPs one execution runs: 2 x result elements x contracted size per ``dot``, loop bodies
    times their known trip count, called computations followed (a conditional's every branch: the
    bound, what runs when each branch is taken). XLA's own ``cost_analysis`` counts a loop body once."""
    comps, entry = _computations(hlo_text)
    memo: dict[str, float] = {}

    def dims(type_text: str) -> list[int]:
        m = _ARRAY.search(type_text)
        return [int(d) for d in m.group(2).split(",") if d.strip()] if m else []

    def total(name: str) -> float:
        if name not in memo:
            memo[name] = 0.0
            types = {}
            flops = 0.0
            for line in comps.get(name, []):
                parsed, named = _parse_instruction(line), _NAME.match(line)
                if parsed is None or named is None:
                    continue
                types[named.group(1)] = parsed[1]
                lhs, contract = _DOT_OPERANDS.search(line), _LHS_CONTRACTING.search(line)
                if parsed[0] == "dot" and lhs and contract and lhs.group(1) in types:
                    shape = dims(types[lhs.group(1)])
                    inner = math.prod(shape[int(i)] for i in contract.group(1).split(",") if i)
                    flops += 2.0 * math.prod(dims(parsed[1])) * inner
                flops += sum(times * total(callee) for callee, times in _callees(line))
            memo[name] = flops
        return memo[name]

    return total(entry)
