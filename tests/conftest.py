"""Force 8 fake CPU devices before anything imports jax (meshes up to 1x8, 2x4, 4x2, 8x1)."""

import gc
import os
import re
from pathlib import Path

_flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
# Tiny test models: XLA's compile time dominates, so skip the backend's expensive optimisations, and emit
# fusions with XLA:CPU's older (elemental) emitters, which compile ~35% faster than the MLIR fusion emitters
# (tests/test_core.py's 2x2 verify: 14 s -> 9 s from a cold cache), and in one LLVM module, not split for
# parallel codegen: on 2 cores shared by 2 test workers the split's threads only add work (a 2x2 verify
# of tiny-llama with controls: ~12% less CPU). Both sides of every comparison are compiled with the same
# flags (subprocesses inherit them); numerics are unaffected beyond rounding order.
# And a collective's participants may arrive late on a loaded machine (three workers on two cores, each
# compiling): XLA:CPU aborts the process when one waits past its termination timeout (LOG(FATAL),
# "Termination timeout ... exceeded"); a slow-tier worker died "Aborted" in a pipeline proof, in CI and
# once locally (8 December 2026). Past 30 minutes, as meshlm's own stall watch (``parallel.watchdog``).
os.environ["XLA_FLAGS"] = (
    _flags
    + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    + " --xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1"
    + " --xla_cpu_collective_call_terminate_timeout_seconds=1800"
).strip()

# Identical XLA programs recur across tests (the unsharded reference on every mesh, the same controls):
# a persistent compilation cache compiles each once. One directory for the whole run: the controller sets
# it before pytest-xdist starts its workers, which inherit it, as do the CLI subprocesses the tests start,
# so a program compiled by one worker is a hit in the other. (JAX writes an entry in place, so a reader
# racing a writer of the same entry can see it half-written: JAX then warns and compiles it again.)
# The directory outlives the run (.gitignore'd): a second local run is mostly hits; CI starts empty.
_cache = os.path.join(os.path.dirname(__file__), "..", ".jax_cache", "main")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _cache)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# Start the backend now, so that no in-process CLI call (``--devices``) can change the device count later.
import jax  # noqa: E402
import pytest  # noqa: E402

jax.devices()

if os.environ.get("MESHLM_CPU_TIMES"):  # each test's CPU time into that directory (tests/cpu_times.py)
    from cpu_times import pytest_collection_finish, pytest_runtest_protocol, pytest_sessionstart  # noqa: F401

# The longest files first. pytest-xdist (``--dist loadfile``) hands out whole files in collection order
# (``--no-loadscope-reorder`` in pyproject.toml keeps this order; its default orders by test count, which
# left the multi-process and pipeline files, a few long tests each, for last): a long file handed out last
# keeps one worker busy while the others have finished. Longest first, by the --durations of a cold run of
# each tier (a file's tests of the other tier drop out of its order); a file whose tests take a minute or
# more in all, in either tier, belongs here. The other files follow in name order.
SLOW_FIRST = (
    # the slow tier's longest (every control traced on 42 configurations, ~10 CPU-min): xdist cannot split
    # a file, so it goes first; in the quick tier it holds two short checks
    "test_every_control.py",
    # the quick tier's longest (the documented commands, ~5 CPU-min together: split by concern in two,
    # the tools' that read presets only apart from those sharing a workspace of inputs), then the proofs
    "test_docs_commands.py",
    "test_docs_tool_commands.py",
    "test_prover.py",
    "test_plain.py",
    "test_core.py",
    "test_deltanet.py",
    "test_moe.py",
    "test_cp.py",
    "test_pp_verify.py",
    "test_transformer.py",
    "test_faults_multiprocess.py",
    "test_train.py",
    "test_plan.py",
    "test_memory_options.py",
    "test_resume.py",
    "test_multiprocess.py",
    "test_pipeline.py",
    "test_lora.py",
    "test_bench.py",
    # the slow tier's other long files (1-4 min each in the full runs)
    "test_mtp.py",
    "test_pp_mixed.py",
    "test_controls_margin.py",
    "test_pp_uneven.py",
    "test_reliability_runs.py",
    "test_distributed.py",
    "test_pp_cli.py",
    "test_finetune.py",
    "test_generate_layouts.py",
    "test_router_proof.py",
    "test_doc_mask.py",
    "test_chat_sft.py",
)


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker more than the cores (``--maxprocesses`` caps it). A worker is idle while
    its test waits on a subprocess (a peer's heartbeat timeout, a launched job's startup); a third worker
    on the 2-core machine fills those waits: the quick tier from an empty cache, CPU 185% -> 196%, 14 min
    22 s -> 13 min 24 s (docs/architecture.md, "The two tiers, measured"). PYTEST_XDIST_AUTO_NUM_WORKERS
    overrides it, as in pytest-xdist."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()  # macOS
    return (cores or 1) + 1


def pytest_collection_modifyitems(items):
    """Whole files move (a file's own order is kept: a stable sort on the file alone)."""
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(scope="module", autouse=True)
def release_compiled_programs(request):
    """In the slow tier (``-m slow``), after each module, JAX's in-memory caches (traced functions,
    compiled programs) are dropped. A worker kept every program of every module it had run: the slow
    tier's three workers grew to 7.1, 5.6 and 4.7 GB, 18.8 GB used of the CI machine's 24 near its end;
    dropped, 4.2 GB at most and 10.8 GB used, the same CPU time (2257 and 2251 s of its tests; sampled
    every 2 s, 7 December 2026). A later module that needs a program again reads it from the persistent
    compilation cache. The quick tier peaked at 5.3 GB used and keeps its programs."""
    yield
    if request.config.option.markexpr == "slow":
        jax.clear_caches()


@pytest.fixture(scope="module")
def collect_orbax_garbage():
    """After a read or write error orbax leaves coroutines un-awaited and posts to closed event loops;
    Python reports those as "unraisable" when it collects them (they are orbax's, and harmless).
    Collecting at the end of each module that uses this fixture lands the reports there, where they are
    filtered (``pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")``), not in
    a later module. Once a module, not once a test: a full collection of a test worker's heap (JAX's
    programs, torch) took 2-5 s, paid by each of test_checkpoint's and test_faults_checkpoint's ~60 tests."""
    yield
    gc.collect()


@pytest.fixture
def children_import_meshlm(monkeypatch):
    """Subprocesses import this checkout's meshlm even when it is not pip-installed."""
    src = str(Path(__file__).resolve().parents[1] / "src")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])))
