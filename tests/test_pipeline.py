"""The pipeline engine proven: GPipe, 1F1B and interleaved 1F1B equal the sequential model in float64 to
<= 1e-12 with NaN in every bubble, each planted fault caught, 1F1B's memory flat in M and GPipe's growing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from meshlm.errors import ConfigError, MeshError
from meshlm.parallel.axes import DP, PP
from meshlm.parallel.pipeline import Pipeline, pipeline_value_and_grad
from meshlm.parallel.pipeline_schedule import PipelineConfig, schedule_facts, schedule_table
from meshlm.perf.hlo import ops_per_step
from meshlm.perf.schedule_png import draw_schedule, schedule_boxes
from meshlm.proof.pipeline_proof import CONTROLS, applicable_controls, prove_pipeline
from meshlm.proof.pipeline_verify import count_permutes

D, H = 4, 8  # width and hidden width of the test stage's layers


def stage_fn(params, x):
    """Consecutive residual MLP layers, parameters stacked [layers, ...] (any number of layers)."""

    def layer(x, w):
        return x + jnp.tanh(x @ w["w1"] + w["b1"]) @ w["w2"], None

    return lax.scan(layer, x, params)[0]


def loss_fn(y, targets):
    return jnp.mean((y - targets) ** 2)


def _problem(n_layers, batch, d=D, h=H, seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 5)
    params = {
        "w1": jax.random.normal(k[0], (n_layers, d, h)) / 2,
        "b1": jax.random.normal(k[1], (n_layers, h)),
        "w2": jax.random.normal(k[2], (n_layers, h, d)) / 3,
    }
    return params, jax.random.normal(k[3], (batch, d)), jax.random.normal(k[4], (batch, d))


def _mesh(pp, dp=1):
    devices = np.array(jax.devices()[: pp * dp])
    return Mesh(devices.reshape(pp, dp), (PP, DP)) if dp > 1 else Mesh(devices, (PP,))


def _prove(schedule, pp, m, v=1, dp=1, controls=True, layers_per_chunk=2):
    cfg = PipelineConfig(pp, m, schedule, v)
    with jax.enable_x64(True):
        params, x, targets = _problem(cfg.chunks * layers_per_chunk, 2 * m * dp)
        return prove_pipeline(stage_fn, loss_fn, _mesh(pp, dp), cfg, params, x, targets, controls=controls)


# Two tiers: pp = 2 of each schedule (with every control) quick; pp = 4 slow: the same schedules on more
# stages (their cost is their scale).
CASES = [  # schedule, pp, microbatches, virtual stages
    ("gpipe", 2, 4, 1),
    pytest.param("gpipe", 4, 3, 1, marks=pytest.mark.slow),  # M < pp: a larger bubble, still exact
    ("1f1b", 2, 4, 1),
    pytest.param("1f1b", 4, 6, 1, marks=pytest.mark.slow),
    ("interleaved", 2, 4, 2),
    pytest.param("interleaved", 4, 4, 2, marks=pytest.mark.slow),
]
DP_OF = {2: 2, 4: 1}  # pp = 2 runs on pp x dp = 2 x 2 (interleaved 2 x 4); pp = 4 alone, with every control


@pytest.mark.parametrize(("schedule", "pp", "m", "v"), CASES)
def test_schedule_equals_sequential_with_nan_bubbles(schedule, pp, m, v):
    """Every bubble holds NaN: a finite, exact result shows that none reaches it. At pp = 2 the batch's rows
    are split over dp too (each dp shard's rows into M micro-batches); at pp = 4 each planted fault (the
    controls) must make the comparison fail, once per engine: GPipe's, and the 1F1B engine's through
    interleaved (every control applies there; 1F1B with V = 1 runs them on the real model in
    ``test_pp_verify``)."""
    dp = 4 if schedule == "interleaved" and pp == 2 else DP_OF[pp]
    controls = pp == 4 and schedule != "1f1b"
    proof = _prove(schedule, pp, m, v, dp=dp, controls=controls)
    assert proof.finite, "a bubble's NaN reached the result"
    assert proof.max_rel_err <= 1e-12, proof.errors
    assert set(proof.errors) == {"loss", "x", "['b1']", "['w1']", "['w2']"}
    if controls:
        assert set(proof.controls) == set(applicable_controls(PipelineConfig(pp, m, schedule, v)))
        assert len(proof.controls) == 4 + (v > 1)
        assert all(proof.detected.values()), proof.controls
        assert proof.ok


def test_every_control_applies_somewhere():
    assert set(applicable_controls(PipelineConfig(4, 4, "interleaved", 2))) == set(CONTROLS)
    assert "activations sent to the wrong stage" not in applicable_controls(
        PipelineConfig(2, 4, "interleaved", 2)
    )


def test_1f1b_with_fewer_micro_batches_than_stages_and_data_parallel():
    proof = _prove("1f1b", 4, 2, 1, dp=2, controls=False)
    assert proof.finite and proof.max_rel_err <= 1e-12, proof.errors


# ------------------------------------------------------------------------ the schedule as data


@pytest.mark.parametrize(("schedule", "pp", "m", "v"), CASES + [("1f1b", 1, 3, 1), ("interleaved", 3, 6, 3)])
def test_table_runs_each_slot_once_in_dependency_order(schedule, pp, m, v):
    cfg = PipelineConfig(pp, m, schedule, v)
    when = {}
    for d, row in enumerate(schedule_table(cfg).cells):
        for t, cell in enumerate(row):
            assert len({s.kind for s in cell}) == len(cell), "two slots of one kind in one tick"
            for s in cell:
                assert s.chunk % pp == d and (s.kind, s.microbatch, s.chunk) not in when
                when[s.kind, s.microbatch, s.chunk] = t
    last = cfg.chunks - 1
    assert len(when) == 2 * m * cfg.chunks
    for mb in range(m):
        for k in range(1, cfg.chunks):
            assert when["F", mb, k] > when["F", mb, k - 1]  # an activation needs a tick to travel
            assert when["B", mb, k - 1] > when["B", mb, k]
        assert when["B", mb, last] >= when["F", mb, last]


@pytest.mark.parametrize(("schedule", "v"), [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_bubble_fraction_is_the_tables_idle_share(schedule, v):
    """With a forward and a backward each one unit of device time, a tick costs a unit for each kind of slot
    some device runs in it; the idle share of the devices' time is the stated bubble."""
    for pp, m in [(2, 4), (4, 8), (4, 16)]:
        cfg = PipelineConfig(pp, m, schedule, v)
        cells = schedule_table(cfg).cells
        units = sum(len({s.kind for d in range(pp) for s in cells[d][t]}) for t in range(len(cells[0])))
        busy = 2 * m * v  # per device
        assert schedule_facts(cfg).bubble_fraction == pytest.approx(1 - busy / units, rel=1e-12)
        assert schedule_facts(cfg).bubble_fraction == pytest.approx((pp - 1) / (v * m + pp - 1), rel=1e-12)


def test_live_activations_flat_in_m_for_1f1b_and_growing_for_gpipe():
    one_f_one_b = {m: schedule_table(PipelineConfig(4, m, "1f1b")).live_activations() for m in (8, 16, 32)}
    gpipe = {m: schedule_table(PipelineConfig(4, m, "gpipe")).live_activations() for m in (8, 16, 32)}
    assert one_f_one_b[8] == one_f_one_b[16] == one_f_one_b[32] == (7, 5, 3, 1)  # 2 (pp - 1 - d) + 1
    assert all(gpipe[m] == (m,) * 4 for m in gpipe)
    assert max(schedule_table(PipelineConfig(4, 8, "interleaved", 2)).live_activations()) <= 2 * 8 - 1


@pytest.mark.parametrize(
    ("schedule", "pp", "m", "v"), [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("interleaved", 4, 8, 2)]
)
def test_schedule_picture_is_the_table_and_its_idle_area_the_bubble(schedule, pp, m, v, tmp_path):
    cfg = PipelineConfig(pp, m, schedule, v)
    boxes, units = schedule_boxes(schedule_table(cfg))
    for d in range(pp):
        starts = sorted(b.start for b in boxes if b.stage == d)
        assert len(starts) == len(set(starts)) == 2 * m * v  # every slot once, no two at one time
    assert 1 - len(boxes) / (units * pp) == pytest.approx(schedule_facts(cfg).bubble_fraction, rel=1e-12)
    path = draw_schedule(schedule_table(cfg), tmp_path / "schedule.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("schedule", "pp", "m", "v"), [("gpipe", 4, 3, 1), ("1f1b", 4, 6, 1), ("interleaved", 2, 4, 2)]
)
def test_permutes_per_step_are_the_programs(schedule, pp, m, v):
    cfg = PipelineConfig(pp, m, schedule, v)
    params, x, targets = _problem(cfg.chunks, 2 * m)
    fn = pipeline_value_and_grad(stage_fn, loss_fn, _mesh(pp), Pipeline(cfg))
    assert (
        count_permutes(jax.make_jaxpr(fn)(params, x, targets).jaxpr) == schedule_facts(cfg).permutes_per_step
    )


@pytest.mark.parametrize(("schedule", "v"), [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_no_chunk_forward_runs_twice(schedule, v):
    """The compiled step runs each forward tick's chunk once forward (2 dots a layer) and once backward (4:
    two weight and two input gradients): 6 dots per layer and forward tick, GPipe's count. 1F1B keeps each
    in-flight micro-batch's residuals; when its backward slot re-ran the chunk's forward from the stashed
    input it had 8 (48 instead of 36 at M = 2)."""
    sd = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    params = {"w1": sd(4, 8, 16), "b1": sd(4, 16), "w2": sd(4, 16, 8)}  # 4 layers, pp 2
    for m in (2, 4):
        cfg = PipelineConfig(2, m, schedule, v)
        fn = pipeline_value_and_grad(stage_fn, loss_fn, _mesh(2), Pipeline(cfg))
        text = jax.jit(fn).lower(params, sd(4 * m, 8), sd(4 * m, 8)).compile().as_text()
        assert ops_per_step(text, "dot") == 6 * (4 // cfg.chunks) * cfg.forward_ticks


def test_compiled_memory_flat_in_m_for_1f1b_and_growing_for_gpipe():
    """At a fixed micro-batch size (16 rows) the batch grows with M. Measured (XLA temp bytes per device):
    1F1B 249,440 at M = 4 and at M = 16; GPipe 483,736 -> 1,301,016 (float32, pp = 2, 2 layers per stage of
    width 8, hidden 256)."""
    sd = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    params = {"w1": sd(4, 8, 256), "b1": sd(4, 256), "w2": sd(4, 256, 8)}

    def temp(schedule, m):
        fn = pipeline_value_and_grad(stage_fn, loss_fn, _mesh(2), Pipeline(PipelineConfig(2, m, schedule)))
        compiled = jax.jit(fn).lower(params, sd(16 * m, 8), sd(16 * m, 8)).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    flat = [temp("1f1b", m) for m in (4, 16)]
    grows = [temp("gpipe", m) for m in (4, 16)]
    assert max(flat) <= 1.1 * min(flat), flat
    assert grows[1] > 2 * grows[0] and grows[0] > max(flat), grows


# ------------------------------------------------------------------------ one-line errors


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (dict(pp=2, microbatches=4, schedule="zigzag"), "unknown pipeline schedule"),
        (dict(pp=2, microbatches=4, schedule="interleaved"), "--virtual-stages 2 or more"),
        (dict(pp=2, microbatches=4, schedule="1f1b", virtual_stages=2), "needs --pp-schedule interleaved"),
        (dict(pp=4, microbatches=2, schedule="interleaved", virtual_stages=2), "use a multiple of 4"),
        (dict(pp=4, microbatches=6, schedule="interleaved", virtual_stages=2), "use a multiple of 4"),
        (dict(pp=0, microbatches=4), "must each be at least 1"),
    ],
)
def test_bad_schedule_is_one_line_config_error(kwargs, words):
    with pytest.raises(ConfigError, match=words) as e:
        PipelineConfig(**kwargs)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("cfg", "layers", "batch", "dp", "words"),
    [
        (
            PipelineConfig(2, 2, "interleaved", 2),
            6,
            4,
            1,
            "6 layers cannot be split into pp x virtual stages",
        ),
        (PipelineConfig(4, 2), 6, 4, 1, "use a pp"),
        (PipelineConfig(2, 4), 4, 6, 1, "batch size 6 is not divisible by dp x microbatches = 1 x 4"),
        (PipelineConfig(2, 2), 4, 6, 2, "multiple of 4"),
    ],
)
def test_shapes_the_pipeline_cannot_split_are_one_line_errors(cfg, layers, batch, dp, words):
    params, x, targets = _problem(layers, batch)
    fn = pipeline_value_and_grad(stage_fn, loss_fn, _mesh(cfg.pp, dp), Pipeline(cfg))
    with pytest.raises(ConfigError, match=words) as e:
        jax.eval_shape(fn, params, x, targets)
    assert "\n" not in str(e.value)


def test_targets_of_another_batch_are_refused():
    params, x, targets = _problem(4, 8)
    fn = pipeline_value_and_grad(stage_fn, loss_fn, _mesh(2), Pipeline(PipelineConfig(2, 2)))
    with pytest.raises(ConfigError, match="targets have \\[6\\] rows but the input has 8"):
        jax.eval_shape(fn, params, x, targets[:6])


def test_specs_splitting_the_layer_dimension_are_refused():
    params, x, targets = _problem(4, 8)
    specs = {"w1": P(DP), "b1": P(), "w2": P()}
    fn = pipeline_value_and_grad(stage_fn, loss_fn, _mesh(2, 2), Pipeline(PipelineConfig(2, 2)), specs=specs)
    with pytest.raises(ConfigError, match="splits the layer dimension; the pipeline does") as e:
        jax.eval_shape(fn, params, x, targets)
    assert "\n" not in str(e.value)


def test_mesh_without_the_pipeline_axis_or_of_another_size_is_refused():
    with pytest.raises(MeshError, match="the axis 'pp'"):
        pipeline_value_and_grad(
            stage_fn, loss_fn, Mesh(np.array(jax.devices()[:2]), (DP,)), Pipeline(PipelineConfig(2, 2))
        )
    with pytest.raises(MeshError, match="pp=4"):
        pipeline_value_and_grad(stage_fn, loss_fn, _mesh(2), Pipeline(PipelineConfig(4, 4)))


def _dots(jaxpr, in_cond=False) -> tuple[int, int]:
    """(dot_generals outside any cond, inside one) of a jaxpr, each sub-jaxpr counted once."""
    outside = inside = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            inside, outside = (inside + 1, outside) if in_cond else (inside, outside + 1)
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    o, i = _dots(inner, in_cond or eqn.primitive.name == "cond")
                    outside, inside = outside + o, inside + i
    return outside, inside


@pytest.mark.parametrize(("schedule", "v"), [("1f1b", 1), ("interleaved", 2)])
def test_1f1b_bubble_slots_skip_their_chunk(schedule, v):
    """Every chunk matmul of 1F1B's ticks runs under a ``lax.cond`` on the slot's validity: a bubble is
    skipped, not computed and masked (on fake CPU devices masked work costs real time)."""
    cfg = PipelineConfig(2, 4, schedule, v)
    params, x, targets = _problem(cfg.chunks, 8)
    fn = pipeline_value_and_grad(stage_fn, loss_fn, _mesh(2), Pipeline(cfg))
    outside, inside = _dots(jax.make_jaxpr(fn)(params, x, targets).jaxpr)
    assert outside == 0 and inside > 0, (outside, inside)


def test_with_cp_no_permute_runs_under_a_bubble_cond():
    """With a cp axis the chunk's own ``ppermute``s (the cp ring's) stay out of any ``lax.cond``: XLA:CPU's
    collective-permute waits for every device of the program, so one in a branch another stage skips
    deadlocks. Bubbles there run masked."""
    from meshlm.parallel.axes import CP

    def ring_stage(params, x):  # x varies over cp already (the engine casts activations to every axis)
        return stage_fn(params, x + lax.ppermute(x, CP, [(0, 1), (1, 0)]))

    cfg = PipelineConfig(2, 2, "1f1b")
    params, x, targets = _problem(2, 4)
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), (PP, CP))
    embed = lambda e, inputs: inputs * e  # under cp the engine's input is embedded (its gradient summed)
    fn = pipeline_value_and_grad(ring_stage, loss_fn, mesh, Pipeline(cfg), embed_fn=embed)

    def permutes_in_cond(jaxpr, in_cond=False):
        n = 0
        for eqn in jaxpr.eqns:
            n += in_cond and eqn.primitive.name == "ppermute"
            for value in eqn.params.values():
                for sub in value if isinstance(value, tuple | list) else (value,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        n += permutes_in_cond(inner, in_cond or eqn.primitive.name == "cond")
        return n

    assert permutes_in_cond(jax.make_jaxpr(fn)(params, x, targets, None, jnp.ones(())).jaxpr) == 0
