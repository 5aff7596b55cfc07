"""docs/architecture.md's "Adding an axis" recipe names the real files: each file it names exists under
src/meshlm/, and each `file.py` (`Name`) pair names something that file holds. Text only: cheap."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "meshlm"
PAIR = re.compile(r"`([\w/]+\.py)` \(`([^`]+)`\)")  # `parallel/cp.py` (`ContextParallel`)
FILE = re.compile(r"`([\w/]+\.py)`")


def _section(title: str) -> str:
    text = (ROOT / "docs" / "architecture.md").read_text()
    start = text.index(f"### {title}\n")
    end = text.index("\n## ", start)
    return text[start:end]


def test_the_axis_recipe_names_real_files_and_what_they_hold():
    recipe = _section("Adding an axis")
    steps = re.findall(r"^\d+\. .*?(?=^\d+\. |^\s*$)", recipe, flags=re.M | re.S)
    assert len(steps) >= 7, "the recipe's numbered steps"
    pairs = PAIR.findall(recipe)
    assert len(pairs) >= 9 and all(PAIR.search(step) for step in steps), "each step names a file and a thing"
    for path in FILE.findall(recipe):
        where = ROOT / path if path.startswith("tests/") else SRC / path
        assert where.is_file(), f"the recipe names {path}, which does not exist"
    for path, name in pairs:
        assert name in (SRC / path).read_text(), f"{path} does not hold {name}"
    # the fields the recipe lists are the Axis entry's
    from meshlm.parallel.axes import Axis

    fields = set(Axis.__dataclass_fields__)
    for field in ("uses", "dims", "explain", "kernel", "baseline", "step"):
        assert field in fields and f"`{field}`" in recipe


def test_the_router_recipe_names_real_files_and_what_they_hold():
    """docs/architecture.md's "Adding a router": its files exist, at most 5 numbered ones (a router's
    record, config field, rules row, control and family), and each name it quotes is where it says."""
    from meshlm.model import moe, router_fields, routers
    from meshlm.proof import reference, router_controls, taps
    from meshlm.sharding.rules import logical_dims
    from meshlm.train import optim

    recipe = _section("Adding a router")
    for path in FILE.findall(recipe):
        base = path.split("<family>")[0]
        assert (SRC / base).exists(), f"the recipe names {path}, which does not exist"
    numbered = re.findall(r"^\d+\. `([\w/<>]+\.py)`", recipe, re.M)
    assert numbered[0] == "model/routers.py" and len(numbered) <= 5, numbered
    owners = {
        routers: ("Router", "SCORE", "TOP_K", "combine_scores", "balance_update"),
        routers.Router: ("of", "group_mask", "__call__"),
        moe: ("route", "_router", "expert_activation"),
        router_fields: ("RouterFields", "ROUTER_RANGES", "check_router", "check_softmax_export"),
        router_controls: ("ROUTER_CONTROLS",),
        taps.Tapped: ("group_scores",),
        optim: ("make_step",),
        reference: ("reference_step",),
    }
    for owner, names in owners.items():
        for name in names:
            assert re.search(rf"`(Router\.)?{re.escape(name)}`", recipe), name
            assert hasattr(owner, name), f"the recipe names {name}, which {owner} lacks"
    assert logical_dims("layers/moe/router/balance_bias") is not None  # its rules row
