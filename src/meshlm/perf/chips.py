"""Known accelerators' peak dense bfloat16 matmul throughput, per chip, from their vendors' specs: the
denominator of MFU as MaxText and PaLM state it (model FLOPs over the chip's spec peak), beside the
measured matmul peak (``peak.py``) that meshlm has always used (a CPU has no spec peak: only that).

Keyed on ``jax.devices()[0].device_kind``, which is the runtime's own name for the chip (a TPU v5e
reports "TPU v5 lite"). The spec is the most the chip does; the measured peak is what one large matmul
gets (on the v5e we use: 166 of the spec's 197 TFLOP/s in bf16, 148 in float32).
"""

from __future__ import annotations

# device_kind -> dense bf16 FLOP/s per chip (per device JAX lists: a TPU v4/v5p chip is one device).
SPEC_BF16_PEAK = {
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,  # v5e
    "TPU v5e": 197e12,
    "TPU v5": 459e12,  # v5p
    "TPU v5p": 459e12,
    "TPU v6 lite": 918e12,  # v6e (Trillium)
    "TPU v6e": 918e12,
    "NVIDIA H100 80GB HBM3": 989e12,  # SXM, dense (no sparsity)
    "NVIDIA H100": 989e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100": 312e12,
}


# device_kind -> dense int8 operations/s per chip (int8 x int8 -> int32 matmuls: ``--quant int8``), from
# the same specs: the denominator of an int8 step's MFU beside the bf16 one.
SPEC_INT8_PEAK = {
    "TPU v5 lite": 394e12,  # v5e (measured 376e12 at 8192^3, 2026-12-07)
    "TPU v5e": 394e12,
}

# device_kind -> HBM bandwidth in bytes/s per chip, from the same specs: the denominator of a decode
# step's memory roofline (``decode_roofline``). The v5e's 819 GB/s is also what we measured there.
SPEC_HBM_BANDWIDTH = {
    "TPU v4": 1228e9,
    "TPU v5 lite": 819e9,
    "TPU v5e": 819e9,
    "TPU v5": 2765e9,
    "TPU v5p": 2765e9,
    "TPU v6 lite": 1640e9,
    "TPU v6e": 1640e9,
    "NVIDIA H100 80GB HBM3": 3.35e12,
    "NVIDIA H100": 3.35e12,
    "NVIDIA A100-SXM4-80GB": 2.039e12,
    "NVIDIA A100-SXM4-40GB": 1.555e12,
    "NVIDIA A100": 1.555e12,
}


def _lookup(table: dict[str, float], device_kind: str) -> float | None:
    if device_kind in table:
        return table[device_kind]
    prefixes = [k for k in table if k.startswith("NVIDIA") and device_kind.startswith(k)]
    return table[max(prefixes, key=len)] if prefixes else None


def hbm_bandwidth(device_kind: str) -> float | None:
    """The chip's spec memory bandwidth in bytes/s, or None (a chip not in the table, every CPU)."""
    return _lookup(SPEC_HBM_BANDWIDTH, device_kind)


def decode_roofline(gen: dict, device_kind: str) -> dict:
    """A generation bench's decode step against its memory roofline: the time to read what one step
    must read on a device (its parameters and KV cache: ``gen["decode_bytes_per_device"]``) once at the
    chip's spec bandwidth. {"decode_step_ms", "roofline_ms", "over_roofline"}; the last two None where
    the chip's bandwidth is not known (every CPU)."""
    rate = gen["decode_tokens_per_s"]
    step_ms = 1e3 * gen["batch"] / rate if rate else None
    bandwidth = hbm_bandwidth(device_kind)
    roof_ms = 1e3 * gen["decode_bytes_per_device"] / bandwidth if bandwidth else None
    over = step_ms / roof_ms if step_ms and roof_ms else None
    return {"decode_step_ms": step_ms, "roofline_ms": roof_ms, "over_roofline": over}


def spec_bf16_peak(device_kind: str) -> float | None:
    """The chip's spec bf16 peak in FLOP/s, or None for a chip not in the table (and every CPU). An
    exact name first, then the longest known name the device kind starts with (GPU names carry their
    memory size: "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB")."""
    return _lookup(SPEC_BF16_PEAK, device_kind)


def spec_int8_peak(device_kind: str) -> float | None:
    """The chip's spec int8 peak in operations/s, or None for a chip not in the table (every CPU)."""
    return _lookup(SPEC_INT8_PEAK, device_kind)


def device_kind() -> str:
    """The runtime's name of the first device's chip (e.g. "TPU v5 lite", "cpu")."""
    import jax

    return jax.devices()[0].device_kind
