"""The rules table's PartitionSpecs of every preset on a set of layouts, against a snapshot taken
before the table named logical dimensions (``tests/data/spec_snapshot.json``): the same spec for
every parameter, the same one-line error where a mesh cannot split a preset.

Regenerate (only for an intended change of specs): ``python tests/test_spec_snapshot.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

SNAPSHOT = Path(__file__).parent / "data" / "spec_snapshot.json"
# (dp, mp, options): plain, tensor parallel, KV heads replicated (mp 8), FSDP, SP, pipeline, cp.
LAYOUTS = (
    (1, 1, {}),
    (2, 2, {}),
    (1, 4, {}),
    (1, 8, {}),
    (2, 2, {"fsdp": True}),
    (4, 1, {"fsdp": True}),
    (2, 2, {"sp": True}),
    (1, 2, {"pp": 2, "microbatches": 2}),
    (2, 1, {"cp": 2, "fsdp": True}),
)


def specs_of(names) -> dict:
    from meshlm.errors import ShardingError
    from meshlm.model.config import get_config
    from meshlm.model.transformer import param_shapes
    from meshlm.parallel.layout import Layout
    from meshlm.sharding.rules import model_specs

    out = {}
    for name in names:
        cfg = get_config(name)
        shapes = param_shapes(cfg)
        for dp, mp, options in LAYOUTS:
            layout = Layout(dp=dp, mp=mp, **options)
            try:
                specs = model_specs(cfg, shapes, layout)
                got = {f"{m}/{n}": str(s) for m, leaves in specs.items() for n, s in leaves.items()}
            except ShardingError as e:
                got = {"error": str(e)}
            out[f"{name} {layout.label()}"] = got
    return out


# The tiny presets (every family's parameter paths: each rule of the table) quick; the real-size ones,
# the same rules at their sizes (what divides), slow: its cost is its scale (~15 s of CPU, every preset
# traced for its shapes).
@pytest.mark.parametrize("size", ["tiny", pytest.param("real", marks=pytest.mark.slow)])
def test_every_preset_keeps_its_specs(size):
    want = json.loads(SNAPSHOT.read_text())
    names = sorted({k.split(" ")[0] for k in want if k.startswith("tiny") == (size == "tiny")})
    want = {k: v for k, v in want.items() if k.split(" ")[0] in names}
    got = specs_of(names)
    differ = [key for key in want if got.get(key) != want[key]]
    assert not differ, f"{len(differ)} preset/layout pairs changed specs, e.g. {differ[:3]}"


if __name__ == "__main__":
    from meshlm.model.config import PRESETS

    SNAPSHOT.write_text(json.dumps(specs_of(sorted(PRESETS)), indent=0, sort_keys=True) + "\n")
    print(f"wrote {SNAPSHOT}", file=sys.stderr)
