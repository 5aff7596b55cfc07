"""Rotary frequencies: plain RoPE, Llama 3.x's frequency scaling (``rope_type: "llama3"``) or YaRN
(``rope_type: "yarn"``: DeepSeek-V3, Kimi K2, gpt-oss, Qwen long-context).

``inv_freq(cfg)`` is the one place the rotary inverse frequencies are computed (the model's
``layers.rotary_angles`` and the benchmark's hand-written reference both read it). Llama 3.1 scales
the low frequencies (wavelength > original context / low_freq_factor) down by ``factor``, keeps the
high ones (wavelength < original context / high_freq_factor) and interpolates between the two, exactly
as transformers' ``_compute_llama3_parameters`` does (which computes in float32: so do we, then widen);
with the two factors equal (Llama 4 Scout: 1 and 1) there is no ramp, only the step.

YaRN (Peng et al. 2023, transformers' ``_compute_yarn_parameters``) blends each frequency between the
original (extrapolation) and the one divided by ``factor`` (interpolation) by a linear ramp over the
dimensions whose rotations over the original context fall between ``beta_fast`` and ``beta_slow``, and
scales cos and sin by an ``attention_factor`` (so every rotated score by its square): given, or
0.1 ln(factor) + 1, or with ``mscale`` and ``mscale_all_dim`` the ratio of the two such terms. DeepSeek
also multiplies the softmax scale by ``score_mscale()`` (the ``mscale_all_dim`` term squared): a fact of
the attention that applies it (``model.mla``), not of the frequencies. Evaluated in float32, as
transformers does.

This module must not import JAX: configs are validated before devices exist.
"""

from __future__ import annotations

import dataclasses
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
    rope_type = ""  # a class constant, not a field (its saved record has none): YaRN's is "yarn"

    def __post_init__(self):
        for name in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ConfigError(f"rope_scaling.{name} must be a number > 0, got {value!r}")
        if not self.high_freq_factor >= self.low_freq_factor:  # equal (Llama 4 Scout): a step, no ramp
            raise ConfigError(
                f"rope_scaling.high_freq_factor={self.high_freq_factor} must be at least "
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


def _mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude term 0.1 mscale ln(factor) + 1 (1 when factor <= 1), transformers' get_mscale."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class YarnScaling:
    """YaRN (transformers' rope_type "yarn"), in transformers' names; 0 stands for an absent (null)
    ``mscale``, ``mscale_all_dim`` or ``attention_factor``, as transformers' truthiness reads them."""

    factor: float  # context extension; the interpolated frequencies are divided by it
    original_max_position_embeddings: int  # the context the model was pretrained at
    beta_fast: float = 32.0  # rotations over the original context above which a dim is kept
    beta_slow: float = 1.0  # rotations below which a dim is interpolated
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float = 0.0  # cos and sin times this; 0: derived (``attention_scale``)
    truncate: bool = True  # the ramp's bounds rounded to whole dims
    rope_type: str = "yarn"  # tells a saved record from Llama 3's

    def __post_init__(self):
        for name in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ConfigError(f"rope_scaling.{name} must be a number > 0, got {value!r}")
        for name in ("mscale", "mscale_all_dim", "attention_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ConfigError(f"rope_scaling.{name} must be a number >= 0 (0: none), got {value!r}")
        if not isinstance(self.truncate, bool):
            raise ConfigError(f"rope_scaling.truncate must be true or false, got {self.truncate!r}")
        if self.rope_type != "yarn":
            raise ConfigError(f"rope_scaling.rope_type of YaRN's record is 'yarn', got {self.rope_type!r}")
        object.__setattr__(
            self, "original_max_position_embeddings", int(self.original_max_position_embeddings)
        )
        for name in ("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor"):
            object.__setattr__(self, name, float(getattr(self, name)))

    def attention_scale(self) -> float:
        """cos and sin are multiplied by this (transformers' ``attention_scaling``)."""
        if self.attention_factor:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return _mscale(self.factor, self.mscale) / _mscale(self.factor, self.mscale_all_dim)
        return _mscale(self.factor)

    def score_mscale(self) -> float:
        """DeepSeek's softmax-scale multiplier, mscale(factor, mscale_all_dim)^2 (1 without
        ``mscale_all_dim``: transformers' ``yarn_apply_mscale``)."""
        return _mscale(self.factor, self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0

    def inv_freq(self, rot_dim: int, theta: float) -> np.ndarray:
        """[rot_dim / 2] float32: transformers' blend of extrapolated and interpolated frequencies."""
        f32, old = np.float32, self.original_max_position_embeddings

        def correction_dim(rotations):  # the dim whose wavelength makes ``rotations`` turns over ``old``
            return rot_dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, rot_dim - 1)
        high = high + 0.001 if low == high else high  # transformers' guard against a zero-width ramp
        exponents = np.arange(0, rot_dim, 2).astype(f32) / f32(rot_dim)
        pos = (float(theta) ** exponents.astype(np.float64)).astype(f32)  # torch's pow: rounded once
        ramp = np.clip((np.arange(rot_dim // 2, dtype=f32) - f32(low)) / f32(high - low), 0, 1).astype(f32)
        keep = f32(1) - ramp  # the extrapolated (original) frequency's share
        extrapolated, interpolated = f32(1) / pos, f32(1) / (f32(self.factor) * pos)
        return (interpolated * (f32(1) - keep) + extrapolated * keep).astype(f32)


def scaling_of(value) -> RopeScaling | YarnScaling | None:
    """A saved config's rope_scaling (a dict, a record or None) as its record: YaRN's carries
    ``rope_type: "yarn"``, Llama 3's has none (it predates YaRN)."""
    if isinstance(value, dict) and value.get("rope_type") == "yarn":
        allowed = {f.name for f in dataclasses.fields(YarnScaling)}
        if not set(value) <= allowed or "factor" not in value:
            raise ConfigError(f"rope_scaling of rope_type 'yarn' takes {', '.join(sorted(allowed))}")
        return YarnScaling(**value)
    return value if isinstance(value, YarnScaling) else RopeScaling.of(value)


def attention_scale(scaling) -> float:
    """What cos and sin are multiplied by: YaRN's attention factor, else 1."""
    return scaling.attention_scale() if isinstance(scaling, YarnScaling) else 1.0


def inv_freq(rot_dim: int, theta: float, scaling: RopeScaling | YarnScaling | None = None) -> np.ndarray:
    """The rotary inverse frequencies [rot_dim / 2] (float64): plain RoPE in float64, or with
    ``scaling`` transformers' Llama 3 or YaRN formula evaluated in float32 as transformers does."""
    exponents = np.arange(0, rot_dim, 2, dtype=np.int64)
    if scaling is None:
        return 1.0 / (theta ** (exponents.astype(np.float64) / rot_dim))
    if isinstance(scaling, YarnScaling):
        return scaling.inv_freq(rot_dim, theta).astype(np.float64)
    f32 = np.float32
    power = np.float64(theta) ** (exponents.astype(f32) / f32(rot_dim)).astype(np.float64)
    base = f32(1.0) / power.astype(f32)  # the power rounded from float64: torch's float32 pow, more often
    old = scaling.original_max_position_embeddings
    low_wavelen = f32(old / scaling.low_freq_factor)
    high_wavelen = f32(old / scaling.high_freq_factor)
    wavelen = f32(2 * math.pi) / base
    scaled = np.where(wavelen > low_wavelen, base / f32(scaling.factor), base)
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    if scaling.high_freq_factor == scaling.low_freq_factor:  # a step: scaled above the wavelength, kept below
        if medium.any():  # exactly on it transformers' ramp is 0 / 0 (NaN): refused, not made up
            raise ConfigError(f"rope_scaling: a rotary wavelength is exactly {float(low_wavelen)} (0 / 0)")
        return scaled.astype(np.float64)
    smooth = (f32(old) / wavelen - f32(scaling.low_freq_factor)) / f32(
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (f32(1) - smooth) * scaled / f32(scaling.factor) + smooth * scaled
    return np.where(medium, smoothed, scaled).astype(f32).astype(np.float64)
