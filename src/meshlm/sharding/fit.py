"""The mesh a command runs on when no --mesh is given: the devices' default, made to fit the model.

``parallel.layout.devices_layout`` lays the devices out without looking at the model (default_dp x the
rest, or 1 x all devices). A model whose mp-sharded dimensions that mp does not divide (a tiny Qwen3.5's
2 linear-attention key heads on 4 devices) would then be refused, though nothing was asked of the mesh.
``fitted_layout`` keeps the default where it fits, else takes the largest mp below it (a divisor of it)
that every mp-sharded dimension admits -- the rules table's own check (``rules.model_specs``), so the
answer is the one the run will meet -- and gives the rest of the devices to dp, with a one-line note
saying what it chose and why. An explicit --mesh never comes here: one that does not fit stays an error.
"""

from __future__ import annotations

import dataclasses

from meshlm.errors import MeshError, ShardingError
from meshlm.parallel.layout import Layout, devices_layout
from meshlm.sharding.rules import model_specs


def fitted_layout(cfg, n_devices: int, options: dict, default_dp: int = 1) -> tuple[Layout, str | None]:
    """(the layout, a note when it is not the devices' default): see the module doc. When no mp fits
    (a dimension dp must divide, an option's own rule), the default's error is raised as it was."""
    from meshlm.model.transformer import param_shapes

    default = devices_layout(n_devices, options, default_dp)
    shapes = param_shapes(cfg)
    refusal = None
    for mp in sorted((d for d in range(1, default.mp + 1) if default.mp % d == 0), reverse=True):
        try:
            layout = dataclasses.replace(default, dp=default.dp * default.mp // mp, mp=mp)
            model_specs(cfg, shapes, layout)
        except (ShardingError, MeshError) as e:
            refusal = refusal or e
            continue
        if mp == default.mp:
            return layout, None
        why = str(refusal).split("; choose")[0]
        return layout, (
            f"note: no --mesh given: running on {layout.label()} (mp={mp}, the largest mp the model's "
            f"dimensions admit; the default {default.label()} does not fit: {why}); pass --mesh to choose"
        )
    raise refusal
