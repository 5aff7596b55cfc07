"""meshlm memory: parameter and optimizer-state bytes per device for a preset on a mesh (shapes only).

The quick, compile-free part of ``meshlm plan``, which adds gradients, activations and the compiled
step's peak, and says whether a run fits a device."""

from __future__ import annotations

import json

from meshlm.cli.common import add_common, add_flags, refuse_options, settings_from, setup
from meshlm.settings import MESH_OPTIONS, MeshFlags

# The mesh options memory does not count (``meshlm plan`` does: --fsdp, --sp, --pp, --cp).
REFUSED = MESH_OPTIONS


def add_parser(sub) -> None:
    p = sub.add_parser(
        "memory",
        help="parameter and AdamW bytes per device (nothing allocated; see `plan`)",
    )
    add_common(p, "llama2-7b")
    add_flags(p, MeshFlags, "memory", REFUSED)
    p.set_defaults(fn=run)


def _config(name: str):
    from meshlm.model.config import get_config

    return get_config(name)


def run(args) -> int:
    flags = settings_from(args, MeshFlags)
    refuse_options(args, flags, "memory", REFUSED, " (meshlm plan counts it)")
    layout = setup(args, flags, model=lambda: _config(args.config))
    dp, mp = layout.dp, layout.mp
    from meshlm.model.config import get_config
    from meshlm.perf.memory import memory_report

    report = {
        "config": args.config,
        "mesh": layout.shape,
        **memory_report(get_config(args.config), layout),
    }
    if args.json:
        print(json.dumps(report))
        return 0
    from meshlm.units import format_bytes, in_unit

    active = report["active_params"]
    active = f" ({active:,} active per token)" if active != report["params"] else ""
    print(
        f"{args.config} on {dp}x{mp}: {report['params']:,} parameters{active}, "
        f"{format_bytes(report['param_bytes_total'], 'GiB')} float32 in all"
    )
    print(
        f"  per device: params {format_bytes(report['param_bytes_per_device'], 'GiB', 3)} "
        f"(ideal total/mp + replicated: {in_unit(report['param_bytes_ideal_per_device'], 'GiB'):.3f}), "
        f"params + AdamW moments {format_bytes(report['train_state_bytes_per_device'], 'GiB', 3)}"
    )
    print("  gradients, activations and the compiled step's peak: meshlm plan")
    return 0
