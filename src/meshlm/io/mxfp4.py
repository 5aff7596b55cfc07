"""MXFP4 weights (the OCP microscaling format gpt-oss ships its experts in), dequantised on import.

A quantised tensor ``X`` is two: ``X_blocks`` [..., R, G, 16] uint8, each byte two FP4 (e2m1) codes,
the low nibble first, so a row of G groups holds 32 G values; and ``X_scales`` [..., R, G] uint8, each
group's power of two biased by 127. Value = ``FP4[code]`` x 2^(scale - 127), laid out [..., R, 32 G]
and then the last two dims swapped, exactly as transformers' ``convert_moe_packed_tensors`` does
(gpt-oss's ``gate_up_proj_blocks`` [E, 2I, D/32, 16] becomes ``gate_up_proj`` [E, D, 2I]). Every such
value is exact in float32 (two significant bits; transformers' bfloat16 holds them exactly too).
"""

from __future__ import annotations

import numpy as np

from meshlm.errors import CheckpointError

# e2m1's sixteen codes: sign bit, two exponent bits, one mantissa bit (transformers' ``FP4_VALUES``).
FP4 = np.asarray(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32
)
BLOCKS, SCALES = "_blocks", "_scales"


def dequantise(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """[..., R, G, B] uint8 codes and [..., R, G] uint8 scales -> [..., 2 B G, R] float32 (module doc)."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.shape[:-1] != scales.shape:
        raise CheckpointError(
            f"MXFP4 blocks {blocks.shape} {blocks.dtype} and scales {scales.shape} {scales.dtype} do not "
            "pair (uint8 both, the scales one per block); re-download the checkpoint"
        )
    values = np.stack([FP4[blocks & 0x0F], FP4[blocks >> 4]], axis=-1)  # [..., R, G, B, 2]: low first
    values = np.ldexp(values, scales.astype(np.int32)[..., None, None] - 127)
    out = values.reshape(*blocks.shape[:-2], -1)  # [..., R, 2 B G]
    return np.ascontiguousarray(np.swapaxes(out, -1, -2))


def dequantise_all(tensors: dict) -> list[str]:
    """Replace every ``X_blocks`` / ``X_scales`` pair in ``tensors`` by the float32 ``X``, in place;
    the names of the tensors dequantised (an unpaired half is left for the name check to report)."""
    done = []
    for name in sorted(n for n in tensors if n.endswith(BLOCKS)):
        base = name[: -len(BLOCKS)]
        if base + SCALES in tensors:
            tensors[base] = dequantise(tensors.pop(name), tensors.pop(base + SCALES))
            done.append(base)
    return done
