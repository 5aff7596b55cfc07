"""Checkpoints: bitwise round trips across meshes, pruning, crashes, corruption, mismatches."""

import os
import resource
import shutil
import signal
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshlm.errors import CheckpointError
from meshlm.io.checkpoint import Checkpointer
from meshlm.io.integrity import _fingerprint
from meshlm.io.layout import COMMIT_MARKER, TMP_SUFFIX, is_checkpoint_dir, resolve
from meshlm.parallel.axes import DP, MP
from meshlm.parallel.mesh import make_mesh

# orbax's "unraisable" reports after read/write errors, collected into this module's tests and
# filtered here (the ``collect_orbax_garbage`` fixture, conftest.py).
pytestmark = [
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
    pytest.mark.usefixtures("collect_orbax_garbage"),
]


SPECS = {
    "params": {
        "w": P(None, MP),  # float32, columns split
        "emb": P(MP),  # bfloat16, rows split
        "big": P(DP, MP),  # float32, large enough to live in its own chunk file
    },
    "opt_state": {"mu": {"w": P(None, MP)}, "count": P()},
    "step": P(),  # int32 scalar, replicated
}
META = {"model_config": {"d_model": 16, "n_layers": 2}, "seed": 0, "data_position": 123}


def host_state(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "params": {
            "w": rng.standard_normal((8, 16)).astype(np.float32),
            "emb": rng.standard_normal((16, 8)).astype(jnp.bfloat16),
            "big": rng.standard_normal((64, 128)).astype(np.float32),
        },
        "opt_state": {
            "mu": {"w": rng.standard_normal((8, 16)).astype(np.float32)},
            "count": np.array(7, np.int32),
        },
        "step": np.array(seed, np.int32),
    }


def shardings(mesh: Mesh) -> dict:
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), SPECS)


def place(host: dict, mesh: Mesh) -> dict:
    return jax.tree.map(jax.device_put, host, shardings(mesh))


def abstract(mesh: Mesh, host: dict | None = None) -> dict:
    host = host_state() if host is None else host
    sds = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
    return jax.tree.map(sds, host, shardings(mesh))


def assert_bitwise(restored: dict, host: dict, mesh: Mesh) -> None:
    for got, want, sharding in zip(
        jax.tree.leaves(restored),
        jax.tree.leaves(host),
        jax.tree.leaves(shardings(mesh)),
        strict=True,
    ):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
        assert got.sharding.is_equivalent_to(sharding, got.ndim), (got.sharding, sharding)


def saved(tmp_path: Path, steps=(1, 2), keep: int = 3, mesh=None) -> Checkpointer:
    ckpt = Checkpointer(tmp_path / "run", keep=keep)
    mesh = mesh or make_mesh(2, 2)
    for step in steps:
        ckpt.save(step, place(host_state(step), mesh), {**META, "step": step})
    return ckpt


def largest_data_file(step_dir: Path) -> Path:
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    return max(files, key=lambda p: p.stat().st_size)


def test_round_trip_is_bitwise_with_shardings_and_meta(tmp_path):
    mesh = make_mesh(2, 2)
    with saved(tmp_path, steps=(5,)) as ckpt:
        state, meta, step = ckpt.restore(abstract(mesh))
        assert step == 5 and meta == {**META, "step": 5}
        assert_bitwise(state, host_state(5), mesh)
        assert ckpt.read_meta() == meta == ckpt.read_meta(5)


@pytest.mark.parametrize("target", [(1, 4), (4, 1), (1, 1)])
def test_restore_onto_other_meshes_and_back(tmp_path, target):
    source, other = make_mesh(2, 2), make_mesh(*target)
    with saved(tmp_path, steps=(1,)) as ckpt:
        state, _, _ = ckpt.restore(abstract(other))
        assert_bitwise(state, host_state(1), other)
        ckpt.save(2, state, META)  # saved from the other mesh ...
        back, _, step = ckpt.restore(abstract(source))  # ... restores onto the original
        assert step == 2
        assert_bitwise(back, host_state(1), source)


def test_round_trip_of_narrow_dtypes(tmp_path):
    mesh = make_mesh(2, 2)
    rng = np.random.default_rng(0)
    host = {
        "mask": rng.random((4, 8)) > 0.5,
        "i8": rng.integers(-128, 127, (4, 8)).astype(np.int8),
        "f16": rng.standard_normal((4, 8)).astype(np.float16),
        "f8": rng.standard_normal((4, 8)).astype(jnp.float8_e4m3fn),
        "u32": rng.integers(0, 2**32, (4, 8), dtype=np.uint32),
    }
    sharding = NamedSharding(mesh, P(DP, MP))
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, jax.tree.map(lambda a: jax.device_put(a, sharding), host), {})
        target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), host)
        state, _, _ = ckpt.restore(target)
    for key, want in host.items():
        assert state[key].dtype == want.dtype
        assert np.asarray(state[key]).tobytes() == want.tobytes(), key


def test_keep_prunes_oldest(tmp_path):
    with saved(tmp_path, steps=(1, 2, 3, 4), keep=2) as ckpt:
        assert ckpt.all_steps() == [3, 4] and ckpt.latest_step() == 4
        assert sorted(p.name for p in ckpt.directory.iterdir()) == ["3", "4"]


def test_interrupted_save_is_ignored_with_warning(tmp_path):
    with saved(tmp_path) as ckpt:
        # a crash mid-save leaves orbax's tmp directory behind
        shutil.copytree(ckpt.step_dir(2), ckpt.directory / f"3{TMP_SUFFIX}")
        # and a step directory whose commit marker never got written
        shutil.copytree(ckpt.step_dir(2), ckpt.step_dir(4))
        (ckpt.step_dir(4) / COMMIT_MARKER).unlink()
        assert ckpt.latest_step() == 2 and ckpt.all_steps() == [1, 2]
        with pytest.warns(UserWarning) as caught:
            _, meta, step = ckpt.restore(abstract(make_mesh(2, 2)))
        assert step == 2 and meta["step"] == 2
        text = " ".join(str(w.message) for w in caught)
        assert f"3{TMP_SUFFIX}" in text and "4" in text and COMMIT_MARKER in text
        with pytest.raises(CheckpointError, match="step 4"):
            ckpt.restore(abstract(make_mesh(2, 2)), step=4)
        ckpt.save(3, place(host_state(3), make_mesh(2, 2)), META)  # replaces the debris
        assert ckpt.all_steps() == [1, 2, 3]
        assert not (ckpt.directory / f"3{TMP_SUFFIX}").exists()


def test_failed_save_leaves_earlier_checkpoints(tmp_path):
    """A write error mid-save (file-size limit, as on a full disk) is a CheckpointError naming
    the directory; no step is half-committed and nothing earlier is pruned."""
    ckpt = saved(tmp_path, steps=(1,), keep=1)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, old_limit[1]))
    try:
        with pytest.raises(CheckpointError, match=str(ckpt.directory)):
            ckpt.save(2, place(host_state(2), make_mesh(2, 2)), META)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert ckpt.all_steps() == [1]
    with pytest.warns(UserWarning, match=f"2{TMP_SUFFIX}: an interrupted save"):
        _, _, step = ckpt.restore(abstract(make_mesh(2, 2)))
    assert step == 1
    ckpt.save(2, place(host_state(2), make_mesh(2, 2)), META)  # works again once there is room
    assert ckpt.all_steps() == [2]
    assert sorted(p.name for p in ckpt.directory.iterdir()) == ["2"]
    ckpt.close()


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_truncated_or_deleted_array_file(tmp_path, damage):
    mesh = make_mesh(2, 2)
    with saved(tmp_path) as ckpt:
        victim = largest_data_file(ckpt.step_dir(2))  # chunks of ['params']['big']
        if damage == "truncate":
            os.truncate(victim, victim.stat().st_size // 2)
            names = rf"damaged file: {victim} is truncated .*holds array params\.big"
        else:
            victim.unlink()
            names = rf"missing file: {victim} \(deleted or moved\); it holds array params\.big"
        with pytest.raises(CheckpointError, match=names):
            ckpt.restore(abstract(mesh), step=2)
        with pytest.warns(UserWarning, match="skipping corrupt checkpoint step 2"):
            state, _, step = ckpt.restore(abstract(mesh))
        assert step == 1
        assert_bitwise(state, host_state(1), mesh)


def test_deleted_manifest_names_the_file(tmp_path):
    with saved(tmp_path) as ckpt:
        manifest = ckpt.step_dir(2) / "state" / "manifest.ocdbt"
        manifest.unlink()
        with pytest.raises(CheckpointError, match=f"missing file: {manifest}"):
            ckpt.restore(abstract(make_mesh(2, 2)), step=2)


def test_flipped_byte_is_caught_by_fingerprint(tmp_path):
    """orbax loads a flipped byte in chunk data silently; the fingerprint catches it."""
    with saved(tmp_path) as ckpt:
        victim = largest_data_file(ckpt.step_dir(2))
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
        with pytest.raises(CheckpointError, match=r"\['params'\]\['big'\].*fingerprint"):
            ckpt.restore(abstract(make_mesh(2, 2)), step=2)


def test_missing_or_garbled_meta(tmp_path):
    with saved(tmp_path) as ckpt:
        (ckpt.step_dir(2) / "meta" / "metadata").unlink()
        (ckpt.step_dir(1) / "meta" / "metadata").write_text('{"model_con')
        with pytest.raises(CheckpointError, match=r"2/meta/metadata"):
            ckpt.read_meta(2)
        with pytest.warns(UserWarning), pytest.raises(CheckpointError, match="all of steps .1, 2. failed"):
            ckpt.restore(abstract(make_mesh(2, 2)))


def test_edited_meta_is_corrupt_and_resume_sets_it_aside(tmp_path):
    """The meta is covered by the integrity record: an edit is damage, like a flipped array byte."""
    with saved(tmp_path) as ckpt:
        meta_file = ckpt.step_dir(2) / "meta" / "metadata"
        meta_file.write_text(meta_file.read_text().replace('"data_position": 123', '"data_position": 124'))
        modified = rf"{ckpt.step_dir(2)} \(meta/metadata\) was modified or damaged after saving"
        with pytest.raises(CheckpointError, match=modified):
            ckpt.read_meta(2)
        with pytest.warns(UserWarning, match=f"skipping corrupt checkpoint step 2: .*{modified}"):
            assert ckpt.read_meta()["step"] == 1
        with pytest.warns(UserWarning, match=rf"moved .*2 aside to 2\.corrupt-.*{modified}"):
            _, meta, step = ckpt.resume(abstract(make_mesh(2, 2)))
        assert (step, meta["step"]) == (1, 1) and ckpt.all_steps() == [1]


def test_meta_mismatch_names_each_field(tmp_path):
    expected = {"model_config": {"d_model": 32, "n_layers": 2}, "seed": 1}
    with saved(tmp_path) as ckpt:
        with pytest.raises(CheckpointError) as err:
            ckpt.restore(abstract(make_mesh(2, 2)), expect_meta=expected)
        message = str(err.value)
        assert "model_config.d_model: saved 16, expected 32" in message
        assert "seed: saved 0, expected 1" in message and "n_layers" not in message
        ckpt.restore(abstract(make_mesh(2, 2)), expect_meta={"model_config": META["model_config"]})


def test_shape_dtype_and_structure_mismatch_name_the_path(tmp_path):
    mesh = make_mesh(2, 2)
    host = host_state()
    host["params"]["w"] = np.zeros((8, 32), np.float32)
    with saved(tmp_path) as ckpt:
        with pytest.raises(CheckpointError, match=r"\['params'\]\['w'\].*\(8, 16\).*\(8, 32\)"):
            ckpt.restore(abstract(mesh, host))
        host = host_state()
        host["params"]["emb"] = host["params"]["emb"].astype(np.float32)
        with pytest.raises(CheckpointError, match=r"\['emb'\].*bfloat16.*float32"):
            ckpt.restore(abstract(mesh, host))
        odd = abstract(mesh)
        odd["params"]["w"] = jax.ShapeDtypeStruct((8, 16), np.float32)  # no sharding
        odd["params"]["big"] = abstract(make_mesh(1, 3))["params"]["big"]  # 3 does not divide 128
        with pytest.raises(CheckpointError) as err:
            ckpt.restore(odd)
        assert "['params']['w']: no sharding" in str(err.value)
        assert "['params']['big']" in str(err.value) and "128" in str(err.value)
        partial = abstract(mesh)
        del partial["opt_state"]
        with pytest.raises(CheckpointError, match=r"\['opt_state'\]\['count'\]: in the checkp"):
            ckpt.restore(partial)


def test_empty_or_missing_directory(tmp_path):
    for directory in (tmp_path, tmp_path / "nope"):
        ckpt = Checkpointer(directory)
        assert ckpt.latest_step() is None and ckpt.all_steps() == []
        with pytest.raises(CheckpointError, match=f"no checkpoint in {directory}.*--out"):
            ckpt.restore(abstract(make_mesh(1, 1)))
        with pytest.raises(CheckpointError, match="no checkpoint"):
            ckpt.read_meta()
        ckpt.close()
    assert not (tmp_path / "nope").exists()  # restoring never creates directories


def test_unwritable_directory(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(CheckpointError, match=f"{afile}.*not a directory"):
        Checkpointer(afile)
    ckpt = Checkpointer(afile / "run")
    with pytest.raises(CheckpointError, match=f"could not save step 1 to {afile / 'run'}"):
        ckpt.save(1, place(host_state(), make_mesh(1, 1)), META)
    ckpt.close()


def chmod_stops_writes(directory: Path) -> bool:
    """False as root (or with CAP_DAC_OVERRIDE), where permissions do not stop writes."""
    directory.chmod(0o555)
    try:
        (directory / "probe").touch()
    except PermissionError:
        return True
    finally:
        directory.chmod(0o755)
    (directory / "probe").unlink()
    return False


def test_read_only_directory(tmp_path):
    ckpt = saved(tmp_path, steps=(1,))
    if not chmod_stops_writes(ckpt.directory):
        pytest.skip("permissions do not stop writes for this user (root)")
    ckpt.directory.chmod(0o555)
    try:
        with pytest.raises(CheckpointError, match=str(ckpt.directory)):
            ckpt.save(2, place(host_state(), make_mesh(2, 2)), META)
    finally:
        ckpt.directory.chmod(0o755)
    assert ckpt.all_steps() == [1]
    ckpt.close()


def test_bad_save_arguments(tmp_path):
    with saved(tmp_path, steps=(1,)) as ckpt:
        state = place(host_state(), make_mesh(2, 2))
        with pytest.raises(CheckpointError, match="already exists"):
            ckpt.save(1, state, META)
        with pytest.raises(CheckpointError, match="JSON"):
            ckpt.save(2, state, {"config": object()})
        assert ckpt.all_steps() == [1]
    with pytest.raises(CheckpointError, match="keep"):
        Checkpointer(tmp_path / "x", keep=0)


def test_resolve_and_is_checkpoint_dir(tmp_path):
    with saved(tmp_path) as ckpt:
        run = ckpt.directory
        assert resolve(run) == (run, None)
        assert resolve(run / "1") == (run, 1)
        assert is_checkpoint_dir(run) and is_checkpoint_dir(run / "2")
        shutil.copytree(run / "2", run / f"3{TMP_SUFFIX}")
        with pytest.raises(CheckpointError, match="incomplete"):
            resolve(run / f"3{TMP_SUFFIX}")
    assert not is_checkpoint_dir(tmp_path / "nope") and not is_checkpoint_dir(tmp_path)
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        resolve(tmp_path)


def test_fingerprint_ignores_sharding_but_not_bits():
    x = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    prints = {
        tuple(np.asarray(_fingerprint(jax.device_put(x, NamedSharding(make_mesh(*m), spec)))))
        for m, spec in [((2, 2), P(DP, MP)), ((1, 4), P(None, MP)), ((1, 1), P())]
    }
    assert len(prints) == 1
    y = x.copy()
    y.view(np.uint32)[3, 5] ^= 1  # one bit
    assert tuple(np.asarray(_fingerprint(y))) not in prints
    assert tuple(np.asarray(_fingerprint(x.T.copy().T))) in prints  # same values, other layout
    swapped = x.copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert tuple(np.asarray(_fingerprint(swapped))) not in prints


@pytest.mark.parametrize("where", ["root", "process"])
def test_an_emptied_manifest_refuses_the_step_and_resume_falls_back(tmp_path, where):
    """A zero-length manifest.ocdbt in the newest step (issue 66, item 5): the root's fails to decode;
    a process's own restored unnoticed (orbax reads through the root index). Both refuse the step,
    naming the file, and a resume sets it aside and continues from the step before, bit for bit."""
    mesh = make_mesh(2, 2)
    with saved(tmp_path) as ckpt:
        state = ckpt.step_dir(2) / "state"
        manifest = (
            state / "manifest.ocdbt" if where == "root" else state / "ocdbt.process_0" / "manifest.ocdbt"
        )
        manifest.write_bytes(b"")
        with pytest.raises(CheckpointError, match=f"{manifest}"):
            ckpt.restore(abstract(mesh), step=2)
        with pytest.warns(UserWarning, match="moved .* aside .*: corrupt"):
            restored, _, step = ckpt.resume(abstract(mesh))
        assert step == 1
        assert_bitwise(restored, host_state(1), mesh)
