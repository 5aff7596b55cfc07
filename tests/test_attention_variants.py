"""The attention variant record (``model/attention_variants.py``): the kernels take it and name no
variant, and docs/architecture.md's "Adding an attention variant" recipe names the real files and
functions."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm.model import attention, attention_variants, blockwise, context_parallel
from meshlm.model.attention_variants import Variant, variant_of

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "meshlm"
KERNELS = ("model/blockwise.py", "model/context_parallel.py")
VARIANT_WORDS = re.compile(r"softcap|soft_cap|sink|chunk_size|nope", re.IGNORECASE)


def _recipe() -> str:
    text = (ROOT / "docs" / "architecture.md").read_text()
    start = text.index("### Adding an attention variant")
    end = min(text.index("\n## ", start), text.index("\n### ", start + 1))
    return text[start:end]


def test_the_recipe_names_real_files_and_functions():
    recipe = _recipe()
    files = set(re.findall(r"`((?:model|sharding|proof|parallel)/[\w/<>]+\.py)`", recipe))
    assert "model/attention_variants.py" in files and len(files) >= 7
    for name in files:
        if "<family>" in name:
            assert (SRC / name.split("<family>")[0]).is_dir(), name
        else:
            assert (SRC / name).is_file(), f"the recipe names {name}, which is not in src/meshlm"
    numbered = re.findall(r"^\d+\. `([\w/<>]+\.py)`", recipe, re.MULTILINE)
    assert len(numbered) <= 5, numbered  # the files a learned per-head term (sinks) touches
    owners = {
        attention_variants: ("Variant", "mask_mod", "block_needed", "score_mod", "score_mod_slope"),
        Variant: ("query", "rules", "finish", "finish_probs", "cotangent", "of"),
        attention: ("_attend", "layer_variant", "kind_tables"),
        context_parallel: ("_step_variant",),
    }
    for owner, names in owners.items():
        for name in names:
            assert re.search(rf"`(Variant\.)?{name}(\(\))?`", recipe), name
            assert hasattr(owner, name), f"the recipe names {name}, which {owner} lacks"


def test_the_kernels_name_no_variant():
    for name in KERNELS:
        hits = [line for line in (SRC / name).read_text().splitlines() if VARIANT_WORDS.search(line)]
        assert not hits, f"{name} names a variant: {hits}"


def test_soft_capping_is_named_in_few_files():
    """Outside the families, the soft-cap is named by its record (``model/attention_variants.py``, which
    also holds its transformers names for the export's check), its config field, plain attention's hook
    (which transformers' order and the tests plant), its kernel controls (``proof/cp_controls.py``), its
    family controls (``proof/family_faults.py``) and the flash kernel's boundary, where JAX's splash
    kernel takes it as a parameter of its own (``model/flash_kernel.py``: ``kernel_rule``): 6, from 10."""
    out = subprocess.run(["grep", "-rliE", "soft.?cap", str(SRC)], capture_output=True, text=True).stdout
    named = sorted(Path(p).relative_to(SRC).as_posix() for p in out.split() if "/families/" not in p)
    assert len(named) <= 6, named


def test_a_variant_is_a_pytree_of_its_traced_parts():
    v = Variant(window=jnp.int32(3), softcap=0.5, scalar=24.0)
    leaves, tree = jax.tree.flatten(v)
    assert len(leaves) == 1 and jax.tree.unflatten(tree, leaves) == v
    assert Variant(window=0).rules() == {} and Variant(window=4).rules() == {"window": 4}
    assert Variant(window=0).for_kernel().window is None
    assert variant_of(window=4) == Variant(window=4)
    with pytest.raises(TypeError, match="either a variant or its fields"):
        variant_of(v, window=4)


def test_the_score_rule_and_its_slope():
    s = jnp.linspace(-3.0, 3.0, 7)
    v = Variant(softcap=2.0)
    assert np.allclose(v.score(s), 2.0 * np.tanh(np.asarray(s) / 2.0), rtol=1e-6)
    slope = jax.vmap(jax.grad(v.score))(s)
    assert np.allclose(v.score_slope(s), slope, rtol=1e-6)
    assert Variant().score(s) is s and Variant().score_slope(s) == 1.0


def test_the_block_mask_is_derived_from_the_mask():
    """Every K/V block the derived rule skips has no visible pair (causal, a window of 5, document
    starts at 0 and 10; blocks of 4 over 24 positions), and the window skips blocks the causal rule keeps."""
    pos = np.arange(24)
    starts = np.where(pos >= 10, 10, 0)
    computed = {}
    for window in (None, 5):
        rules = {} if window is None else {"window": window}
        computed[window] = 0
        for qi in range(0, 24, 4):
            for ki in range(0, 24, 4):
                qp, kp = jnp.asarray(pos[qi : qi + 4])[None], jnp.asarray(pos[ki : ki + 4])[None]
                qs = jnp.asarray(starts[qi : qi + 4])[None]
                kvalid = jnp.ones_like(kp, bool)
                vis = blockwise._visible(qp, kp, kvalid, True, qs, **rules)
                if not bool(blockwise._needed(qp, kp, kvalid, True, qs, **rules)):
                    assert not bool(jnp.any(vis)), (window, qi, ki)
                else:
                    computed[window] += 1
    assert computed[5] < computed[None] <= 21  # the causal triangle of 6 blocks, less the documents'
