"""``meshlm generate`` from a checkpoint trained under --cp and under --pp, on another mesh: checkpoints do
not depend on the layout they were trained on (cp splits data, pp the stacked layer dimension), so the
greedy tokens are the same on every mesh; ``meshlm eval --cp 2`` of the cp checkpoint equals eval without
cp. A checkpoint trained with ``--pp 2 --cp 2`` together generates the same way (issue 35)."""

import json

import pytest
from helpers import run_cli, tiny_lm_config, write_corpus

from meshlm.parallel.layout import Layout
from meshlm.train.loop import train

BLOCKS = dict(attention="blockwise", attn_block=8)  # the cp ring's kernel: blocks of 8 of each 16-token shard
LAYOUTS = {
    "cp2": (dict(cp=2), BLOCKS),
    "pp2": (dict(pp=2, microbatches=2), {}),
    "pp2 x cp2": (dict(pp=2, microbatches=2, cp=2), BLOCKS),
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


# slow: two training runs (cp, pp) for one generate each (its cost); a checkpoint's independence of the
# layout: tests/test_checkpoint.py's restores, quick
@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
def test_generate_from_a_checkpoint_trained_under_cp_or_pp_on_any_mesh(name, corpus, tmp_path, capsys):
    axes, model = LAYOUTS[name]
    layout = Layout(mp=2, **axes)  # pp x cp included: no layout here is refused
    train(tiny_lm_config(corpus, tmp_path, steps=1, **axes, **model), layout)
    capsys.readouterr()  # training's own lines
    out = {}
    for mesh in ("1x1", "2x2"):
        argv = ["--checkpoint", str(tmp_path), "--mesh", mesh, "--prompt", "def ", "--max-new-tokens", "6"]
        assert run_cli("generate", *argv, "--temperature", "0", "--json") == 0
        out[mesh] = json.loads(capsys.readouterr().out)["tokens"]  # one prompt: one object
    assert len(out["1x1"]) == 6 and out["1x1"] == out["2x2"]
    if name == "cp2":  # meshlm eval --cp 2 on the same checkpoint and data equals eval without cp
        losses = []
        for cp in ([], ["--cp", "2"]):
            argv = [
                "--checkpoint",
                str(tmp_path),
                "--data",
                f"{corpus}/f0.py",
                "--mesh",
                "1x2",
                "--seq-len",
                "32",
            ]
            assert run_cli("eval", *argv, *cp, "--batch-size", "2", "--json") == 0
            losses.append(json.loads(capsys.readouterr().out.splitlines()[-1])["loss"])
        assert losses[1] == pytest.approx(losses[0], rel=1e-6)
