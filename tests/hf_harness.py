"""The transformers comparison every tests/test_hf_*.py family file runs, written once.

A family file declares its tiny transformers models as ``Case`` records and gets, per case, one
conversion (module-scoped) and three tests::

    from hf_harness import Case, Comparison, GreedyText, family_fixture

    CASES = [Case("qwen3", "Qwen3ForCausalLM", lambda: transformers.Qwen3Config(...))]
    family = family_fixture(CASES)  # the module's ``family`` fixture: one conversion per case

    class TestTransformers(Comparison, GreedyText):  # GreedyText left out where generate is refused
        pass  # (a Test* name: pytest collects the inherited tests in the family's module)

A config starts from ``hf_helpers.TINY`` (and ``ROPE``) plus the family's own fields;
``kv_slots(local, more_than)`` is the ``Case.generated`` check of a windowed family's KV cache.

- ``Comparison.test_logits_equal_transformers``: the config reads ``Case.reads``; our logits equal
  transformers' within ``Case.tol`` unsharded; with ``Case.fused``, transformers 5's in-memory (fused
  expert) tensors read to the very same parameters. ``..._on_2x2`` (slow): on every model shard of 2x2.
- ``Comparison.test_export_loads_in_transformers`` (slow): the export loads as ``Case.model_cls`` with
  equal logits and converts back to the same config.
- ``GreedyText.test_generate_prints_transformers_text[1x1|sharded]`` (slow): ``meshlm generate
  --temperature 0`` prints transformers' greedy text (1x1 with ``--json``, checked further by
  ``Case.generated``; the sharded mesh ``Case.sharded`` streamed as a user sees it).

What is truly the family's stays in its file and takes the same ``family`` fixture, a dict: case,
hf (directory), ckpt (converted 1x1, where ``Case.generate``), fused, model, tokens [2, length],
logits (transformers'), text (greedy). ``drift(family, **changes)`` is our unsharded logits' distance
from transformers': the check that a bug common to the sharded and the unsharded run (invisible to
verify) must fail. A family-specific test picks its cases by name:
``@pytest.mark.parametrize("family", ["phi3"], indirect=True)``.
"""

import io
import json
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext, redirect_stderr, redirect_stdout
from copy import deepcopy
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import numpy as np
import pytest
from helpers import run_cli, sharded_logits
from hf_helpers import (
    CORPUS,
    NEW,
    PROMPT,
    RTOL,
    VOCAB,
    bpe_tokenizer,
    export_round_trip,
    hf_logits,
    our_logits,
    perturbed_model,
    random_tokens,
    rel,
    write_fused,
)

from meshlm.io import hf_weights
from meshlm.model.params import unflatten


@dataclass(frozen=True)
class Case:
    """One tiny random transformers model to convert and compare (no download)."""

    name: str  # the test id; the family meshlm must read unless ``reads`` names another
    model_cls: str  # the transformers class (the export must load as it)
    config: Callable[[], Any]  # builds its transformers config
    reads: dict = field(default_factory=dict)  # config fields meshlm must read from it
    init: float = 0.3  # initializer_range: peaked logits, greedy neither degenerate nor near a tie
    norm_noise: float = 0.3  # the norm weights' perturbation (the others': 0.05)
    seed: int = 0
    eager: bool = False  # transformers' eager attention (its sdpa path ignores soft-caps)
    length: int = 16  # the compared tokens: [2, length]
    new: int = NEW  # greedy tokens generated
    sharded: tuple = ("--mesh", "1x2")  # the generate test's sharded mesh, as CLI arguments
    fused: bool = False  # MoE: also write and read transformers 5's fused expert tensors
    change: dict = field(default_factory=dict)  # cfg.replace(**change) before every comparison
    tol: float = RTOL  # float32 logits: max |ours - theirs| / max |theirs|
    generate: bool = True  # False: no tokenizer, checkpoint or greedy text (generation refused)
    generated: Callable[[dict], None] | None = None  # more checks of 1x1 generate --json's object
    prepare: Callable[[Any], None] | None = None  # sets what perturbed_model leaves (buffers), in place
    # our float32 logits against transformers' model run in float64 (its own float32 rounding can exceed
    # ours: Qwen3.5's delta rule in float32); the export round trip still compares its float32 logits
    reference64: bool = False
    # with reference64: a context manager factory inside which transformers' float64 run also computes
    # in float64 what its code casts to float32 (Gemma 4's rotary angles, norms and softmax)
    lifted: Callable[[], AbstractContextManager] | None = None

    def load(self, hf_dir, **changes):
        """(cfg, flat) read from ``hf_dir`` with ``change`` and ``changes`` applied."""
        cfg, flat = hf_weights.load_hf(hf_dir)
        return cfg.replace(**{**self.change, **changes}), flat


@cache
def _tokenizer():
    return bpe_tokenizer(CORPUS, VOCAB)  # one BPE training per test process


def convert(case: Case, root) -> dict:
    """Build, save and run ``case``'s model once: the dict the tests share (converted on first use)."""
    import torch
    import transformers

    torch.manual_seed(case.seed)
    hf_cfg = case.config()
    if case.eager:
        hf_cfg._attn_implementation = "eager"
    model = perturbed_model(getattr(transformers, case.model_cls), hf_cfg, case.init, case.norm_noise)
    if case.prepare is not None:
        with torch.no_grad():
            case.prepare(model)
    tokens = random_tokens(case.length)
    model.save_pretrained(root / "hf")
    out = dict(case=case, hf=root / "hf", fused=None, model=model, tokens=tokens)
    out.update(logits=hf_logits(model, tokens))
    out["reference"] = out["logits"]
    if case.reference64:
        with (case.lifted or nullcontext)():
            out["reference"] = hf_logits(deepcopy(model).double(), tokens)
    if case.fused:
        write_fused(model, root / "hf", root / "fused")
        out["fused"] = root / "fused"
    return Family(out)


class Family(dict):
    """The ``family`` dict, whose "ckpt" and "text" (``_generated``) are made on first use, by the tests
    that read them (the slow tier's): a BPE training, the conversion and transformers' generate, 1-3 s
    of CPU a case that the quick tier's comparisons never read."""

    def __missing__(self, key):
        if key not in ("ckpt", "text"):
            raise KeyError(key)
        ckpt = self["hf"].parent / "ckpt"
        self.update(ckpt=ckpt, text=_generated(self, ckpt) if self["case"].generate else None)
        return self[key]


def _generated(out: dict, ckpt) -> str:
    """Convert ``out``'s model to ``ckpt`` (1x1, with a tokenizer) and return transformers' greedy text
    of its prompt."""
    import torch

    case, model = out["case"], out["model"]
    tokenizer = _tokenizer()
    tokenizer.save_pretrained(out["hf"])
    argv = ("convert", "--from-hf", str(out["hf"]), "--out", str(ckpt), "--mesh", "1x1")
    said = io.StringIO()  # not into the output a test is capturing when it first reads the family's text
    with redirect_stdout(said), redirect_stderr(said):
        assert run_cli(*argv) == 0, said.getvalue()
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        new = model.generate(ids, max_new_tokens=case.new, do_sample=False, pad_token_id=0)[0, ids.shape[1] :]
    assert len(set(new.tolist())) > 3  # not degenerate: a wrong token shows
    return tokenizer.decode(new, skip_special_tokens=True)


def family_fixture(cases):
    """The module-scoped ``family`` fixture over ``cases`` (ids: their names), one conversion each;
    a family-specific test picks cases with ``@pytest.mark.parametrize("family", [...], indirect=True)``
    (by name)."""
    by_name = {c.name: c for c in cases}

    @pytest.fixture(scope="module", params=list(by_name))
    def family(request, tmp_path_factory):
        pytest.importorskip("transformers")
        return convert(by_name[request.param], tmp_path_factory.mktemp(request.param))

    return family


def kv_slots(local: int | None, more_than: int):
    """A ``Case.generated`` check: generate --json's ``kv_cache`` holds ``local`` slots (rolling) in
    the windowed layers (None: no windowed layer) and more than ``more_than`` (the context) in the
    full ones."""

    def check(out):
        cache = out["kv_cache"]
        assert cache.get("local_slots") == local and cache["slots"] > more_than

    return check


def drift(family: dict, **changes) -> float:
    """Our unsharded logits' distance from transformers' (read afresh from the directory, so a planted
    reader or model change applies), with ``changes`` to the read config."""
    cfg, flat = family["case"].load(family["hf"], **changes)
    return rel(our_logits(cfg, flat, family["tokens"]), family["logits"])


class Comparison:
    """Logits (unsharded and 2x2) and the export round trip: see the module docstring.

    Two tiers: the unsharded comparison (the reader and the model against transformers) is quick; the 2x2
    logits and the export round trip are slow: the sharded run equals the unsharded one by the quick
    tier's proofs, and the writer's round trip is proven quick on Llama and GPT-J (tests/test_hf.py), so
    these are the same checks on every family (their cost is their scale: ~13 families)."""

    def test_logits_equal_transformers(self, family):
        case, want = family["case"], family["reference"]
        cfg, flat = case.load(family["hf"])
        reads = {"family": case.name, **case.reads}
        assert {k: getattr(cfg, k) for k in reads} == reads
        assert rel(our_logits(cfg, flat, family["tokens"]), want) <= case.tol
        if family["fused"] is not None:  # bitwise the same parameters: the logits above are theirs
            fused = hf_weights.load_hf(family["fused"])[1]
            assert fused.keys() == flat.keys() and all(np.array_equal(fused[k], flat[k]) for k in flat)

    @pytest.mark.slow
    def test_logits_equal_transformers_on_2x2(self, family):
        case, want = family["case"], family["reference"]
        cfg, flat = case.load(family["hf"])
        # each 2x2 shard's, within twice the unsharded tolerance: the mp row sums round in another order
        # (tiny Gemma 4's first shard measured 1.08e-5 against its 1e-5, 6 December 2026, whether or not
        # remat "none" wraps the layer); the float64 proofs hold the sharding to 1e-12
        for copy in sharded_logits(cfg, unflatten(flat), family["tokens"]):
            assert rel(copy, want) <= 2 * case.tol

    @pytest.mark.slow
    def test_export_loads_in_transformers(self, family, tmp_path):
        case = family["case"]
        load = {"attn_implementation": "eager"} if case.eager else {}
        name, err, same = export_round_trip(
            family["hf"], tmp_path, family["tokens"], family["logits"], **load
        )
        assert (name, same) == (case.model_cls, True) and err <= case.tol


class GreedyText:
    """``meshlm generate --temperature 0`` prints transformers' greedy text: see the module docstring.
    Slow: the same check on every family (its scale); generate prints transformers' greedy text quick in
    tests/test_hf_tokenizer.py (Llama, GPT-J, 1x1), and cached decoding equals the full forward quick in
    tests/test_generate.py."""

    @pytest.mark.slow
    @pytest.mark.parametrize("mesh", ["1x1", "sharded"])
    def test_generate_prints_transformers_text(self, family, mesh, capsys):
        case = family["case"]
        capsys.readouterr()
        where = ("--mesh", "1x1", "--json") if mesh == "1x1" else case.sharded
        argv = ["generate", "--checkpoint", str(family["ckpt"]), *where, "--temperature", "0"]
        assert run_cli(*argv, "--prompt", PROMPT, "--max-new-tokens", str(case.new)) == 0
        printed = capsys.readouterr().out
        if mesh == "sharded":
            assert printed == PROMPT + family["text"] + "\n"
            return
        out = json.loads(printed)
        assert out["text"] == family["text"]
        if case.generated is not None:
            case.generated(out)
