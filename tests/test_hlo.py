"""The collective counter counts exactly the collectives XLA compiled, and nothing else."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from meshlm.parallel.axes import DP, MP
from meshlm.parallel.mesh import make_mesh
from meshlm.perf.hlo import (
    COLLECTIVES,
    collectives_from_text,
    collectives_of,
    collectives_per_step,
    group_size,
    shape_bytes,
)

F32_8x16 = 8 * 16 * 4


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(2, 2)


def _count(mesh, body, out_specs, x_shape=(16, 32)):
    # check_vma=False: outputs such as all_gather results are replicated in ways the checker
    # cannot infer; replication is irrelevant to what gets compiled here.
    f = jax.shard_map(body, mesh=mesh, in_specs=P(DP, MP), out_specs=out_specs, check_vma=False)
    compiled = jax.jit(f).lower(jnp.ones(x_shape, jnp.float32)).compile()
    return collectives_of(compiled)


def _only(counts, **expected):
    """Every kind not named in ``expected`` must be absent."""
    want = {name: {"count": 0, "bytes": 0} for name in COLLECTIVES}
    for key, (count, nbytes) in expected.items():
        want[key.replace("_", "-")] = {"count": count, "bytes": nbytes}
    assert counts == want


def test_two_dependent_psums(mesh):
    # The sine between them keeps XLA from combining the two all-reduces into one.
    body = lambda a: jax.lax.psum(jnp.sin(jax.lax.psum(a, MP)), DP)
    _only(_count(mesh, body, P(DP, MP)), all_reduce=(2, 2 * F32_8x16))


def test_independent_psums_bytes_survive_combining(mesh):
    # XLA's all-reduce combiner may merge independent psums into one tuple all-reduce (CPU does
    # in JAX 0.10.2), so only the bytes are fixed; the count is 1 or 2.
    body = lambda a: (jax.lax.psum(a, MP), jax.lax.psum(2 * a, MP))
    counts = _count(mesh, body, (P(DP), P(DP)))
    assert counts["all-reduce"]["bytes"] == 2 * F32_8x16
    assert counts["all-reduce"]["count"] in (1, 2)


def test_all_gather(mesh):
    body = lambda a: jax.lax.all_gather(a, MP, tiled=True)
    _only(_count(mesh, body, P(DP)), all_gather=(1, 8 * 32 * 4))


def test_psum_scatter(mesh):
    body = lambda a: jax.lax.psum_scatter(a, MP, scatter_dimension=0, tiled=True)
    _only(_count(mesh, body, P(DP, MP)), reduce_scatter=(1, 4 * 16 * 4))


def test_ppermute(mesh):
    body = lambda a: jax.lax.ppermute(a, MP, [(0, 1), (1, 0)])
    _only(_count(mesh, body, P(DP, MP)), collective_permute=(1, F32_8x16))


def test_all_to_all(mesh):
    body = lambda a: jax.lax.all_to_all(a, MP, 0, 1, tiled=True)
    counts = _count(mesh, body, P(DP, MP))
    # CPU XLA splits the operand into a tuple per peer; bytes still total the one f32[8,16].
    _only(counts, all_to_all=(1, F32_8x16))


def test_local_program_has_none(mesh):
    body = lambda a: jnp.tanh(a) @ a.T
    _only(_count(mesh, body, P(DP, MP)))


def test_sync_op_and_names_are_not_confused():
    text = """
%add (x: f32[], y: f32[]) -> f32[] {
  ROOT %add = f32[] add(%x, %y)
}
%all-reduce.1 (x: f32[], y: f32[]) -> f32[] {
  ROOT %all-gather = f32[] add(%x, %y)
}
ENTRY %main (p: f32[8,16]) -> f32[8,16] {
  %p = f32[8,16]{1,0} parameter(0), metadata={op_name="jit(f)/all-reduce"}
  %all-reduce.3 = f32[8,16]{1,0} all-reduce(%p), replica_groups={{0,1}}, to_apply=%all-reduce.1
  ROOT %copy.all-to-all = f32[8,16]{1,0} copy(%all-reduce.3)
}
"""
    counts = collectives_from_text(text)
    assert counts["all-reduce"] == {"count": 1, "bytes": F32_8x16}
    assert sum(c["count"] for c in counts.values()) == 1


def test_async_pairs_count_once_with_real_result_bytes():
    text = """
ENTRY %main (p: f32[8,16]) -> f32[8,16] {
  %ars = f32[8,16]{1,0} all-reduce-start(%p), replica_groups={{0,1}}, to_apply=%add
  %ard = f32[8,16]{1,0} all-reduce-done(%ars)
  %ags = (f32[8,16]{1,0}, f32[16,16]{1,0}) all-gather-start(%ard), dimensions={0}
  %agd = f32[16,16]{1,0} all-gather-done(%ags)
  %cps = (f32[8,16]{1,0}, f32[8,16]{1,0}, u32[], u32[]) collective-permute-start(%p)
  ROOT %cpd = f32[8,16]{1,0} collective-permute-done(%cps)
}
"""
    counts = collectives_from_text(text)
    assert counts["all-reduce"] == {"count": 1, "bytes": F32_8x16}
    assert counts["all-gather"] == {"count": 1, "bytes": 16 * 16 * 4}
    assert counts["collective-permute"] == {"count": 1, "bytes": F32_8x16}


def test_tuple_results_sum_elements():
    text = (
        "  %all-reduce = (f32[8,16]{1,0}, bf16[4]{0}, /*index=2*/s32[], pred[3]) "
        "all-reduce(%a, %b, %c, %d), to_apply=%add\n"
        "  ROOT %a2a = (bf16[4,16]{1,0:T(8,128)(2,1)}, bf16[4,16]) all-to-all(%x, %y)\n"
    )
    counts = collectives_from_text(text)
    assert counts["all-reduce"] == {"count": 1, "bytes": 8 * 16 * 4 + 4 * 2 + 4 + 3}
    assert counts["all-to-all"] == {"count": 1, "bytes": 2 * 4 * 16 * 2}


def test_bf16_reduce_scatter_without_percent_names():
    text = "  rs.1 = bf16[4,16]{1,0} reduce-scatter(x), dimensions={0}, to_apply=add\n"
    assert collectives_from_text(text)["reduce-scatter"] == {"count": 1, "bytes": 4 * 16 * 2}


@pytest.mark.parametrize(
    "shape, nbytes",
    [
        ("f64[2,3]", 48),
        ("f16[10]", 20),
        ("s8[7]", 7),
        ("u8[7]", 7),
        ("s64[]", 8),
        ("u32[2]", 8),
        ("pred[5]", 5),
        ("s4[3]", 2),
        ("f8e4m3fn[4]", 4),
        ("c64[2]", 16),
        ("f32[<=8,2]", 64),
        ("token[]", 0),
    ],
)
def test_shape_bytes(shape, nbytes):
    assert shape_bytes(shape) == nbytes


def test_ragged_all_to_all_is_not_all_to_all():
    text = "  %r = f32[8]{0} ragged-all-to-all(%a, %b, %c, %d, %e, %f)\n"
    assert collectives_from_text(text)["all-to-all"]["count"] == 0


def test_group_size_formats():
    assert group_size("x = f32[] all-reduce(y), replica_groups={{0,1},{2,3}}, to_apply=%a") == 2
    assert group_size("x = f32[] all-reduce(y), replica_groups={{0},{1},{2},{3}}, to_apply=%a") == 1
    assert group_size("x = f32[] all-reduce(y), replica_groups=[4,1]<=[4], to_apply=%a") == 1
    mesh_line = "x = f32[] all-reduce(y), replica_groups=mesh['axis_0'=1,'axis_1'=4] {'axis_1'}, to_apply=%a"
    assert group_size(mesh_line) == 4
    assert group_size(mesh_line.replace("{'axis_1'}", "{'axis_0'}")) == 1
    assert group_size("x = f32[] add(y, z)") is None


def test_per_step_counts_loop_bodies_times_trips():
    mesh = make_mesh(2, 2)

    def body(x):  # the sine keeps the three psums from being merged or hoisted
        return jax.lax.fori_loop(0, 3, lambda i, a: jnp.sin(jax.lax.psum(a, MP)), x)

    f = jax.shard_map(body, mesh=mesh, in_specs=P(DP, MP), out_specs=P(DP, MP), check_vma=False)
    text = jax.jit(f).lower(jnp.ones((8, 16), jnp.float32)).compile().as_text()
    counts = collectives_per_step(text)
    assert counts["all-reduce"] == {"count": 3, "bytes": 3 * 4 * 8 * 4}
    assert counts["trivial"] == 0
