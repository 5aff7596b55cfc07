"""What ``meshlm plan`` compiles with, for which chip, and the correction it applies.

A compiled peak is one compiler's buffer plan: XLA:CPU's temporaries are not XLA:TPU's (qwen3-0.6b,
batch 4 x 2048, bf16, --remat full: 13.91 GiB on CPU with plain attention, 8.96 GiB on a v5e with
its flash kernel). So ``--chip v5e`` plans with the chip's own compiler wherever it can:

- on the chip itself: its runtime's compiler (``how="chip"``);
- anywhere else with ``libtpu`` installed (``pip install -e '.[tpu-plan]'``): the same compiler on
  *compile-only* devices of a v5e topology (``jax.experimental.topologies.get_topology_desc``, as
  MaxText's ``train_compile.py``): nothing runs, no chip is needed, and the figure is the chip's
  by construction (qwen3-0.6b above: 15.356 GiB peak here and on the chip);
- else the host's compiler (XLA:CPU) with the chip's calibrated ``Correction`` (``plan_calibration``),
  which says so, and its measured error, in the report.

Without ``--chip`` the plan is the host's compiler's, uncorrected, and says that too.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

from meshlm.errors import ConfigError
from meshlm.perf.plan_calibration import CORRECTIONS, Correction

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str  # --chip: "v5e"
    device_kind: str  # the runtime's name of it (``jax.devices()[0].device_kind``)
    topology: str  # libtpu's name of its slices: "v5e" -> "v5e:2x4"
    usable_bytes: int  # one chip's memory a program may use (the runtime's ``bytes_limit``)
    memory_source: str  # where ``usable_bytes`` comes from


# usable_bytes: the runtime's bytes_limit (HBM less its reserve); scripts/plan_calibration.py's first
# line prints it on the chip. v5e: 15.75 GiB ("15.7 GiB usable" in docs/memory.md); v6e: 32 GiB HBM
# less the same reserve, not measured on a chip by meshlm (pass --device-memory to plan for another).
CHIPS = {
    "v5e": Chip("v5e", "TPU v5 lite", "v5e", int(15.75 * GiB), "the v5e runtime's limit"),
    "v6e": Chip("v6e", "TPU v6 lite", "v6e", int(31.25 * GiB), "32 GiB HBM less v5e's reserve: unmeasured"),
}
CHIP_NAMES = tuple(CHIPS)
COMPILERS = ("auto", "chip", "host")  # --compiler


@dataclasses.dataclass(frozen=True)
class Target:
    """What the planner compiles for: the chip (or None: this host's devices), how, and the correction."""

    chip: Chip | None
    how: str  # "host": this host's devices and compiler; "chip": the chip's compiler (there or compile-only)
    platform: str  # the platform compiled for ("tpu", "cpu", "gpu"): what --attention auto resolves on
    compiler: str  # the report's words for the compiler
    devices: tuple | None = None  # compile-only devices (None: ``jax.devices()``)
    correction: Correction | None = None

    def place(self, layout):
        """``layout`` with its mesh on this target's devices (compile-only ones, or the host's)."""
        if self.devices is None:
            return layout
        from meshlm.parallel.mesh import make_mesh

        shape = layout.mesh_shape
        return layout.replace(built_mesh=make_mesh(*shape.values(), axes=tuple(shape), devices=self.devices))

    def describe(self) -> dict:
        """The report's "compiler" entry (JSON)."""
        return {
            "chip": self.chip.name if self.chip else None,
            "how": self.how,
            "platform": self.platform,
            "compiler": self.compiler,
            "correction": self.correction.describe() if self.correction else None,
        }


def libtpu_version() -> str | None:
    """The installed libtpu's version (the TPU compiler), or None where it is not installed."""
    if importlib.util.find_spec("libtpu") is None:
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("libtpu")
    except PackageNotFoundError:
        return "unknown version"


def check_chip(chip: str | None, compiler: str) -> None:
    """One-line errors for --chip / --compiler before any work."""
    if chip is not None and chip not in CHIPS:
        raise ConfigError(f"--chip {chip!r}: known chips: {', '.join(CHIPS)}")
    if compiler not in COMPILERS:
        raise ConfigError(f"--compiler {compiler!r}; valid: {', '.join(COMPILERS)}")
    if chip is None and compiler != "auto":
        raise ConfigError(f"--compiler {compiler} chooses a chip's compiler or the host's: add --chip v5e")


def resolve(chip: str | None, compiler: str, n_devices: int) -> Target:
    """The target for --chip ``chip`` (None: this host) and --compiler ``compiler``, for a mesh of
    ``n_devices`` (names checked already: ``check_chip``); a one-line error where the chip's compiler
    is asked for and absent, or no correction of the host's exists. Needs JAX's devices set up."""
    import jax

    host = jax.default_backend()
    if chip is None:
        return Target(None, "host", host, f"XLA:{host.upper()} for this host's {host} devices")
    spec = CHIPS[chip]
    if compiler != "host" and _on_chip(spec):
        return Target(spec, "chip", "tpu", f"XLA:TPU on this {spec.name} ({spec.device_kind})")
    if compiler != "host" and (version := libtpu_version()) is not None:
        devices = compile_only_devices(spec, n_devices)
        words = f"XLA:TPU (libtpu {version}) for compile-only {spec.name} devices: the chip's own compiler"
        return Target(spec, "chip", "tpu", words, devices=devices)
    if compiler == "chip":
        raise ConfigError(
            f"--compiler chip: {chip}'s compiler is libtpu, not installed here; "
            "pip install -e '.[tpu-plan]' (or --compiler host: XLA:CPU with the calibrated correction)"
        )
    if chip not in CORRECTIONS:
        raise ConfigError(
            f"--chip {chip}: no calibrated correction of XLA:CPU's plan for it; "
            "pip install -e '.[tpu-plan]' to compile with its own compiler"
        )
    return Target(
        spec, "host", host, f"XLA:{host.upper()} for this host's devices", correction=CORRECTIONS[chip]
    )


def _on_chip(spec: Chip) -> bool:
    import jax

    return jax.default_backend() == "tpu" and jax.devices()[0].device_kind == spec.device_kind


def slice_shape(n: int) -> tuple[int, int]:
    """The 2-D slice of ``n`` chips (a power of 2): 1x1, 1x2, 2x2, 2x4, 4x4 ... (as near square)."""
    if n < 1 or n & (n - 1):
        raise ConfigError(f"--chip plans a slice of a power-of-2 number of chips; the mesh has {n}")
    x = 1 << ((n.bit_length() - 1) // 2)
    return x, n // x


def compile_only_devices(spec: Chip, n: int) -> tuple:
    """``n`` compile-only devices of a ``spec`` slice (libtpu's compiler, no chip needed)."""
    # No chip is used: the metadata server and libtpu's one-process lock are for running ones.
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    x, y = slice_shape(n)
    bounds = {} if x * y >= 4 else {"chips_per_host_bounds": (x, y, 1)}  # a host holds 2x2 chips
    try:
        topology = topologies.get_topology_desc(f"{spec.topology}:{x}x{y}", "tpu", **bounds)
    except Exception as e:  # noqa: BLE001 - libtpu's own message, on one line
        raise ConfigError(f"libtpu cannot describe a {spec.name} {x}x{y} slice: {e}") from None
    return tuple(topology.devices)
