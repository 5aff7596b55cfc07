"""matmul_peak_flops returns a usable number; no timing assertions (CI machines vary)."""

import math

import pytest

from meshlm.errors import ConfigError
from meshlm.perf.peak import matmul_peak_flops


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_returns_positive_finite(dtype):
    flops = matmul_peak_flops(dtype, n=64, repeats=2)
    assert isinstance(flops, float)
    assert math.isfinite(flops) and flops > 0


@pytest.mark.parametrize("kwargs", [{"n": 0}, {"repeats": 0}, {"dtype": "int32"}, {"dtype": "nope"}])
def test_rejects_bad_arguments(kwargs):
    with pytest.raises(ConfigError):
        matmul_peak_flops(**kwargs)
