"""Byte sizes, written and read one way everywhere: KiB/MiB/GiB/TiB are powers of 2, kB/MB/GB/TB powers
of 10 (accepted when read, e.g. ``--device-memory 80GB``; meshlm itself writes binary units only)."""

from __future__ import annotations

import math
import re

BINARY = {"TiB": 2**40, "GiB": 2**30, "MiB": 2**20, "KiB": 2**10}
DECIMAL = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "kB": 10**3}
UNITS = {**BINARY, **DECIMAL}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]+)\s*")


def in_unit(n: float, unit: str) -> float:
    """``n`` bytes in ``unit`` (e.g. "MiB")."""
    return n / UNITS[unit]


def format_bytes(n: float | None, unit: str | None = None, digits: int | None = 2) -> str:
    """ "1.50 GiB": ``n`` bytes in ``unit``, or in GiB, MiB or KiB, the largest that is at most ``n``
    (KiB below that); ``digits`` after the point (None: the shortest exact form, ``:g``); "-" for None."""
    if n is None:
        return "-"
    if unit is None:
        unit = next((u for u in ("GiB", "MiB") if abs(n) >= BINARY[u]), "KiB")
    value = in_unit(n, unit)
    return f"{value:g} {unit}" if digits is None else f"{value:.{digits}f} {unit}"


def parse_bytes(text: str) -> int:
    """Bytes of "80GiB", "80 GB", "512MiB" (units case-insensitive); ValueError naming the problem."""
    match = _SIZE.fullmatch(text or "")
    units = {u.lower(): n for u, n in UNITS.items()}
    if not match or match.group(2).lower() not in units:
        raise ValueError(f"must be a size with a unit ({', '.join(UNITS)}), e.g. 80GiB, got {text!r}")
    size = float(match.group(1)) * units[match.group(2).lower()]
    if not math.isfinite(size) or size < 1:
        raise ValueError(f"must be a positive size, e.g. 80GiB, got {text!r}")
    return int(size)
