"""The ``Family`` records: every family's facts name existing layer code, and a new family is one record.

The model, the rules table, the collective minimum and the converter look a family's facts up
(``ModelConfig.arch``); nothing branches on a family's name, so a record built from existing blocks
trains, shards and communicates as its facts say without another line of code.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from meshlm.model.config import ModelConfig
from meshlm.model.families import FAMILIES
from meshlm.model.family import REMAT, Family
from meshlm.model.transformer import BLOCKS, NORMS
from meshlm.parallel.mesh import make_mesh
from meshlm.perf.collectives import theoretical_collectives
from meshlm.proof import model_problem, verify


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_names_existing_layer_code(name):
    fam = FAMILIES[name]
    assert fam.name == name
    assert fam.block in BLOCKS
    assert fam.norm is None or fam.norm in NORMS
    assert fam.mlp in ("gelu", "swiglu", "geglu")
    assert (fam.rotary is not None) == fam.attention  # positions enter only through rotary attention
    two = 2 if fam.block in ("sequential", "post_norm", "sandwich", "per_layer") else 1
    # Gemma 4's MoE block: the experts' sum beside the MLP's
    assert fam.row_sums == two + (fam.moe and fam.block == "per_layer")
    assert set(fam.remat) <= set(REMAT)
    if fam.hf is not None:
        assert set(fam.hf.layer) and "embed/embeddings" in fam.hf.top


def test_the_collective_minimum_reads_the_record():
    llama = ModelConfig(family="llama", vocab_size=64, d_model=32, n_layers=3, d_ff=64, n_heads=4)
    gptj = llama.replace(family="gptj")
    assert theoretical_collectives(llama, 1, 2)["layer_forward"] == 3 * 2
    assert theoretical_collectives(gptj, 1, 2)["layer_forward"] == 3 * 1


def test_a_new_family_is_one_record(monkeypatch):
    """A family that exists nowhere else (a parallel block with RMSNorm and a SwiGLU MLP, no biases) is
    proven sharded == unsharded, its communication held to the minimum its record implies."""
    toy = Family(
        name="toy",
        block="parallel",
        attention=True,
        rotary="half",
        norm="rms",
        mlp="swiglu",
        biases=False,
        row_sums=1,
        gpt_init=True,
    )
    monkeypatch.setitem(FAMILIES, "toy", toy)
    cfg = ModelConfig(family="toy", vocab_size=64, d_model=32, n_layers=2, d_ff=64, n_heads=4, max_seq_len=16)
    assert cfg.arch is toy and cfg.rotary_kind == "half"
    problem = model_problem(cfg, "toy", 2, 2, 8)
    with jax.enable_x64(True):
        report = verify(problem, make_mesh(1, 2), dtype=jnp.float64, controls=(), collectives=True)
    assert report.ok, [c for c in report.checks if not c["ok"]]
    assert any("toy on 1x2 (per layer: 1 forward, 1 backward" in c["detail"] for c in report.checks)
