"""The reference must be independent of the sharded program, or the proof proves nothing.

If the "unsharded" reference were (by a refactor) computed by the sharded program itself, every
comparison would pass with an error of exactly 0, every control would still be "detected", and real
sharding bugs would go through. So the proof checks, and reports, four facts (the values compared
are computed by the very jaxprs the first one reads: ``reference.CheckedProgram``):

* the reference's traced program names no mesh axis: no ``shard_map`` and no collective or
  axis-index primitive anywhere in its jaxpr (sub-jaxprs of scans, jits and remat included);
* every reference result (loss, gradients, training state) lives on one device;
* on several devices, not every compared leaf agrees bitwise (``exactness_check``), in float32 and
  float64 alike;
* the sharded program does communicate where the mesh is bigger than one device (its compiled HLO
  has collectives), so what is compared really is a sharded computation.
"""

from __future__ import annotations

import jax
from jax.extend import core as jex_core

from meshlm.perf.hlo import collectives_from_text
from meshlm.proof.report import check_row

# Primitives that only exist with a mesh axis in scope (JAX 0.10 names; older spellings included).
MESH_PRIMITIVES = frozenset(
    {
        "shard_map",
        "axis_index",
        "psum",
        "psum_invariant",
        "pmax",
        "pmin",
        "pvary",
        "pcast",
        "pbroadcast",
        "ppermute",
        "all_gather",
        "all_gather_invariant",
        "psum_scatter",
        "reduce_scatter",
        "all_to_all",
    }
)


def primitives(jaxpr, found: set[str] | None = None) -> set[str]:
    """Every primitive name in ``jaxpr`` and the jaxprs nested in its equations' parameters."""
    found = set() if found is None else found
    for eqn in jaxpr.eqns:
        found.add(eqn.primitive.name)
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                if isinstance(sub, jex_core.ClosedJaxpr):
                    primitives(sub.jaxpr, found)
                elif isinstance(sub, jex_core.Jaxpr):
                    primitives(sub, found)
    return found


def reference_checks(programs, ref_outputs) -> list[dict]:
    """Rows for the reference: the checked programs that computed its values (``CheckedProgram``:
    the jaxpr read here is the one evaluated) name no mesh axis, and its results sit on one device."""
    used = set()
    for program in programs:
        used |= primitives(program.jaxpr) & MESH_PRIMITIVES
    devices = {d for x in jax.tree.leaves(ref_outputs) for d in x.sharding.device_set}
    names = ", ".join(p.name for p in programs)
    if not programs:
        axis_detail = "no checked program computed the reference values"
    elif used:
        axis_detail = f"uses {sorted(used)}: the reference must be the plain unsharded program"
    else:
        axis_detail = f"no shard_map or collective in the jaxprs that computed them ({names})"
    return [
        check_row("reference names no mesh axis", bool(programs) and not used, axis_detail),
        check_row(
            "reference runs on one device",
            len(devices) == 1,
            f"its results live on {len(devices)} devices" if len(devices) != 1 else "results on one device",
        ),
    ]


def exactness_check(counts: dict[str, tuple[int, int]], dtype: str, n_devices: int) -> list[dict]:
    """[] on one device; else a row failing when, in any comparison (``counts``: name -> (leaves that
    differ at all, leaves compared)), every leaf agrees bitwise. Two programs that sum in different
    orders differ in rounding somewhere; agreement to the last bit means that part of the reference is
    the sharded program (e.g. its results moved to one device). float64 too: its rounding differs as
    float32's does (tiny-llama on 2x1, 1x2 and CP2 ring: 0 of 12 gradients bitwise equal), and a
    borrowed reference passed ``--x64`` with an error of exactly 0 while the row was float32's only."""
    if n_devices == 1:
        return []
    exact = [f"{name}: all {n} leaves" for name, (differ, n) in counts.items() if not differ]
    if exact:
        detail = (
            f"{'; '.join(exact)} bitwise equal on {n_devices} devices in {dtype}: suspiciously exact: "
            "is the reference the sharded program?"
        )
    else:
        found = ", ".join(f"{name} {differ} of {n} leaves" for name, (differ, n) in counts.items())
        detail = f"{found} differ in rounding, as two programs summing in different orders do"
    return [check_row("reference is not the sharded program", not exact, detail)]


def sharded_check(compiled_text: str, n_devices: int) -> dict:
    """Row for the sharded program: with more than one device it must communicate."""
    counts = collectives_from_text(compiled_text)
    total = sum(c["count"] for c in counts.values())
    if n_devices == 1:
        return check_row("sharded program communicates", True, "one device: nothing to communicate")
    return check_row(
        "sharded program communicates",
        total > 0,
        f"{total} collectives in its compiled HLO" if total else "no collective: it is not sharded",
    )
