"""Rotary frequencies: plain RoPE, or Llama 3.x's frequency scaling (``rope_type: "llama3"``).

``inv_freq(cfg)`` is the one place the rotary inverse frequencies are computed (the model's
``layers.rotary_angles`` and the benchmark's hand-written reference both read it). Llama 3.1 scales
the low frequencies (wavelength > original context / low_freq_factor) down by ``factor``, keeps the
high ones (wavelength < original context / high_freq_factor) and interpolates between the two, exactly
as transformers' ``_compute_llama3_parameters`` does (which computes in float32: so do we, then widen).

This module must not import JAX: configs are validated before devices exist.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from meshlm.errors import ConfigError


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.x's rotary frequency scaling (transformers' rope_type "llama3"); the field names are
    transformers' own, so a checkpoint's record reads like the config.json it came from."""

    factor: float  # low frequencies are divided by this (8 in Llama 3.1)
    low_freq_factor: float  # wavelengths above original_max_position_embeddings / this are scaled
    high_freq_factor: float  # wavelengths below original_max_position_embeddings / this are kept
    original_max_position_embeddings: int  # the context the model was pretrained at (8192)

    def __post_init__(self):
        for name in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ConfigError(f"rope_scaling.{name} must be a number > 0, got {value!r}")
        if not self.high_freq_factor > self.low_freq_factor:
            raise ConfigError(
                f"rope_scaling.high_freq_factor={self.high_freq_factor} must exceed "
                f"low_freq_factor={self.low_freq_factor}"
            )
        context = int(self.original_max_position_embeddings)
        object.__setattr__(self, "original_max_position_embeddings", context)
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            object.__setattr__(self, name, float(getattr(self, name)))

    @classmethod
    def of(cls, value) -> RopeScaling | None:
        """A record from a saved config's dict (or a record, or None); a bad one is a ConfigError."""
        if value is None or isinstance(value, cls):
            return value
        fields = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        if not isinstance(value, dict) or set(value) != set(fields):
            raise ConfigError(f"rope_scaling must be null or an object with exactly {', '.join(fields)}")
        return cls(**value)


def inv_freq(rot_dim: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
    """The rotary inverse frequencies [rot_dim / 2] (float64): plain RoPE in float64, or with
    ``scaling`` transformers' Llama 3 formula evaluated in float32 as transformers does."""
    exponents = np.arange(0, rot_dim, 2, dtype=np.int64)
    if scaling is None:
        return 1.0 / (theta ** (exponents.astype(np.float64) / rot_dim))
    f32 = np.float32
    base = f32(1.0) / (f32(theta) ** (exponents.astype(f32) / f32(rot_dim)))
    old = scaling.original_max_position_embeddings
    low_wavelen = f32(old / scaling.low_freq_factor)
    high_wavelen = f32(old / scaling.high_freq_factor)
    wavelen = f32(2 * math.pi) / base
    scaled = np.where(wavelen > low_wavelen, base / f32(scaling.factor), base)
    smooth = (f32(old) / wavelen - f32(scaling.low_freq_factor)) / f32(
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (f32(1) - smooth) * scaled / f32(scaling.factor) + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(f32).astype(np.float64)
