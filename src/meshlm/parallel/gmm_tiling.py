"""The tiles of "gmm"'s grouped matmul (``parallel.gmm_kernel``), and --gmm-tiling's text. No JAX here:
the model's config checks the text before anything starts."""

from __future__ import annotations

from meshlm.errors import ConfigError

TILES = (512, 256, 128)  # tm's sizes tried, largest first
LANES = 128  # tk and tn: multiples of the TPU's 128 lanes
COLUMNS = 512  # tk and tn at most (the f32 operands' double-buffered tiles fit the default 16 MiB of VMEM)


def parse_tiling(text: str) -> tuple[int, int, int] | None:
    """--gmm-tiling's text: "auto" -> None (``row_tile``, ``col_tile``), "TM,TK,TN" -> the three ints
    (TM a multiple of 8, TK and TN of 128: the TPU's sublanes and lanes)."""
    if text == "auto":
        return None
    parts = text.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        raise ConfigError(f"--gmm-tiling {text!r}: give auto or three ints TM,TK,TN, e.g. 128,512,512")
    tm, tk, tn = (int(p) for p in parts)
    if tm < 8 or tm % 8 or tk < 128 or tk % 128 or tn < 128 or tn % 128:
        raise ConfigError(
            f"--gmm-tiling {text}: TM must be a positive multiple of 8, TK and TN of 128 (e.g. 128,512,512)"
        )
    return tm, tk, tn


def row_tile(rows: int, groups: int, tiling: tuple[int, int, int] | None = None) -> int:
    """tm for ``rows`` (the static row bound before padding) over ``groups`` groups (module docstring)."""
    if tiling is not None:
        return tiling[0]
    return next((t for t in TILES if (groups - 1) * t * 2 <= rows), TILES[-1])


def col_tile(dim: int, cap: int = COLUMNS) -> int:
    """tk or tn for a dimension of ``dim``: the largest multiple of 128 up to ``cap`` that divides it
    (768: 384), else 128 (the kernel masks the remainder); a dimension below 128 whole (a block equal to
    the array's dimension is always allowed)."""
    if dim < LANES:
        return dim
    return next((t for t in range(cap - cap % LANES, 0, -LANES) if dim % t == 0), LANES)


def tiles(tm: int, k: int, n: int, tiling: tuple[int, int, int] | None) -> tuple[int, int, int]:
    """One kernel call's (tm, tk, tn) for a [M, k] x [k, n] product per group: tk, tn per ``col_tile``,
    capped by ``tiling``'s (None: 512)."""
    caps = (COLUMNS, COLUMNS) if tiling is None else tiling[1:]
    return tm, col_tile(k, caps[0]), col_tile(n, caps[1])
