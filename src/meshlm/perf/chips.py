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


def spec_bf16_peak(device_kind: str) -> float | None:
    """The chip's spec bf16 peak in FLOP/s, or None for a chip not in the table (and every CPU). An
    exact name first, then the longest known name the device kind starts with (GPU names carry their
    memory size: "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB")."""
    if device_kind in SPEC_BF16_PEAK:
        return SPEC_BF16_PEAK[device_kind]
    prefixes = [k for k in SPEC_BF16_PEAK if k.startswith("NVIDIA") and device_kind.startswith(k)]
    return SPEC_BF16_PEAK[max(prefixes, key=len)] if prefixes else None


def device_kind() -> str:
    """The runtime's name of the first device's chip (e.g. "TPU v5 lite", "cpu")."""
    import jax

    return jax.devices()[0].device_kind
