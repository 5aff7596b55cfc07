"""Uneven pipeline stages (``model.stage_layers.slots``, ``sharding.stage_slots``): a body whose layer
count does not split into the chunks runs in chunks of ceil(body / chunks) slots, the padding slots the
identity with their routing statistics dropped. Proven equal to the unsharded model (the real layers)
in float64, with the classic bug planted and detected: a padding slot's routing statistics counted in
the aux loss. (A padding slot that runs its layer is not a
detectable fault while its parameters are zero: a zero residual layer is the identity with zero
gradients; ``stage_slots.chunk``'s ``where`` keeps it the identity whatever the slot holds.)"""

import jax
import jax.numpy as jnp
import numpy as np

from meshlm.model import stage_layers
from meshlm.model.config import get_config
from meshlm.parallel.layout import Layout
from meshlm.proof import model_problem, verify
from meshlm.sharding import stage_slots

FAULTS = ()  # the engine's faults are proven on every schedule (tests/test_pp_verify.py): here the padding


def test_padding_goes_to_the_first_chunks_and_the_tree_round_trips():
    per, real = stage_layers.slots(get_config("deepseek-v3"), 4)  # 58 MoE layers on 4 stages
    assert per == 15 and len(real) == 58 and real[:14] == tuple(range(13)) + (15,)  # stage 0: 13 layers
    assert stage_layers.slots(get_config("deepseek-v3"), 2) is None  # 58 = 2 x 29: no padding
    slots = stage_slots.Slots(3, 2, 2, (0, 2, 3))
    tree = {"layers/attn": {"w": np.arange(6.0).reshape(3, 2)}, "embed": {"embeddings": np.ones((3, 2))}}
    padded = slots.pad(tree)
    assert padded["layers/attn"]["w"].tolist() == [[0, 1], [0, 0], [2, 3], [4, 5]]
    assert padded["embed"]["embeddings"].shape == (3, 2)  # not the body's: as it was
    np.testing.assert_array_equal(slots.unpad(padded)["layers/attn"]["w"], tree["layers/attn"]["w"])


def _verify(name, changes, schedule="gpipe"):
    layout = Layout(pp=2, mp=2, microbatches=2, pp_schedule=schedule)
    cfg = get_config(name).replace(**changes)
    problem = model_problem(cfg, name, layout, 4, 8)
    assert problem.slots is not None  # the body does not split: padded
    with jax.enable_x64(True):
        return verify(problem, layout, steps=1, dtype=jnp.float64, controls=(), pipeline_faults=FAULTS)


def _ok(report):
    return report.ok and report.loss_ok and max(p.max_rel_err for p in report.params) <= 1e-12


def test_deepseek_with_an_odd_moe_body_is_proven():
    # 1 dense layer with the embedding, 3 MoE layers on 2 stages: slots [layer, padding], [layer, layer]
    report = _verify("tiny-deepseek-v3", {"n_layers": 4, "mtp_layers": 0, "mtp_weight": 0.0})
    assert _ok(report), [c for c in report.checks if not c["ok"]]
    assert all(c["detected"] for c in report.controls), report.controls


def test_a_padding_slots_aux_loss_counted_is_detected(monkeypatch):
    # the padding slot's (slot 1's) routing statistics counted with layer 0's: its balance loss added
    real = stage_slots.real_statistics
    monkeypatch.setattr(stage_slots, "real_statistics", lambda slots, a: real(slots, a).at[0].add(a[1]))
    report = _verify("tiny-deepseek-v3", {"n_layers": 4, "mtp_layers": 0, "mtp_weight": 0.0})
    assert not report.loss_ok and not _ok(report)  # the loss gains the padding's balance loss


def test_a_dense_model_with_an_odd_layer_count_is_proven():
    report = _verify("tiny-llama", {"n_layers": 3}, schedule="1f1b")
    assert _ok(report), [c for c in report.checks if not c["ok"]]
