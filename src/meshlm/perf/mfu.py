"""Model FLOP utilisation of a training run on an accelerator, as MaxText reports it: each logged step's
per-device model TFLOP/s and MFU, in metrics.jsonl and the progress bar.

Model FLOPs are bench's (``perf.flops``: 6·N·tokens + attention's 12·L·T·d·tokens, the global batch of
one optimizer step), per device: / step seconds / devices. The denominator is the chip's spec bf16 peak
(``perf.chips``: TPU v5e 197 TFLOP/s ...), or for a chip not in that table its measured bf16 matmul peak
(``perf.peak``, once at start). On CPU nothing is added: a CPU has no spec peak, its measured one moves
with the load of a shared machine, and the rows stay as they were.

The step time is the time between two read-back steps (the row's ``tokens_per_s``'s): the first step's
includes its compile, as its tokens/s does.
"""

from __future__ import annotations

from dataclasses import dataclass

PEAK_N = 8192  # the measured peak's matmul size on an accelerator: launch overhead negligible


def accelerator() -> str | None:
    """The device kind of the run's chips ("TPU v5 lite"), or None on CPU (tests replace this)."""
    import jax

    return None if jax.default_backend() == "cpu" else jax.devices()[0].device_kind


@dataclass(frozen=True)
class Utilisation:
    """The numerator's step FLOPs and the denominator's per-device peak of a run's MFU."""

    flops_per_step: float  # model FLOPs of one optimizer step, the global batch
    devices: int
    peak: float  # per-device FLOP/s
    source: str  # where the peak is from, for the start line

    def row(self, seconds: float) -> dict[str, float]:
        """The metrics row's fields for a step of ``seconds``: per-device TFLOP/s and MFU."""
        per_device = self.flops_per_step / max(seconds, 1e-9) / self.devices
        return {"tflops_per_device": per_device / 1e12, "mfu": per_device / self.peak}

    def line(self) -> str:
        return (
            f"mfu: model FLOPs {self.flops_per_step / 1e12:.3g} TFLOP per step over {self.devices} "
            f"device(s), against {self.source} of {self.peak / 1e12:.0f} TFLOP/s per device"
        )


def utilisation(cfg, batch_size: int, seq_len: int, devices: int) -> Utilisation | None:
    """The run's MFU terms on an accelerator; None on CPU (module docstring)."""
    kind = accelerator()
    if kind is None:
        return None
    from meshlm.model.transformer import param_shapes
    from meshlm.perf.chips import spec_bf16_peak
    from meshlm.perf.flops import model_flops_per_step

    flops = model_flops_per_step(cfg, param_shapes(cfg), batch_size, seq_len)
    spec = spec_bf16_peak(kind)
    if spec is not None:
        return Utilisation(flops, devices, spec, f"{kind}'s spec bf16 peak")
    from meshlm.perf.peak import matmul_peak_flops

    measured = matmul_peak_flops("bfloat16", n=PEAK_N, repeats=5)
    return Utilisation(flops, devices, measured, f"{kind}'s measured bf16 matmul peak (not a known chip)")
