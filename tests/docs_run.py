"""Running the docs' commands (tests/test_docs_commands.py, tests/test_docs_tool_commands.py): a command
line after its entry's substitutions (tests/docs_commands.py), in a workspace directory, in this process
(its 8 fake devices) or, needing more devices, in a subprocess; each distinct command line once."""

import os
import shlex
import shutil
from pathlib import Path

import jax
import pytest
from docs_commands import COMMANDS, Run
from helpers import run_cli, run_meshlm


def argv_of(text: str, entry: Run, loop: tuple) -> list[str]:
    for old, new in (*entry.subs, *loop):
        text = text.replace(old, new, 1)
    return shlex.split(f"{text} {entry.add}")[1:]


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv[:-1] else None


TOOLS = ("bench", "plan", "memory", "configs")  # the commands that read presets only: no workspace inputs
MESH_COMMANDS = ("train", "verify", "generate", "eval", "convert", "bench", "plan", "memory")


def _with_default_mesh(argv: list[str]) -> list[str]:
    """In this process (8 devices) a command without --mesh is given the mesh its default picks on its
    --devices (default 4): dp x (devices / (pp dp cp)), dp 2 for train where it divides (cli/common.py)."""
    if argv[0] not in MESH_COMMANDS or "--mesh" in argv or "--help" in argv or "--matrix" in argv:
        return argv
    n = int(_flag(argv, "--devices") or 4) // int(_flag(argv, "--pp") or 1)
    cp = int(_flag(argv, "--cp") or 1)
    dp = 2 if argv[0] == "train" and "--pp" not in argv and n % (2 * cp) == 0 else 1
    return [*argv, "--mesh", f"{dp}x{max(n // (dp * cp), 1)}"]


class Workspace:
    """The directory the commands run in, and each command line's result (argv -> (code, output))."""

    def __init__(self, root: Path):
        self.root, self.results = root, {}

    def run(self, argv: list[str], capfd) -> tuple[int, str]:
        devices = int(_flag(argv, "--devices") or 0)
        in_process = devices <= len(jax.devices())
        if in_process:
            argv = _with_default_mesh(argv)
        key = tuple(argv)
        if in_process and "--mesh" in argv and "--devices" in argv:  # the devices are this process's
            i = argv.index("--devices")
            key = tuple(argv[:i] + argv[i + 2 :])
        if key not in self.results:
            self._clear_out(argv)
            self.results[key] = self._in_process(argv, capfd) if in_process else self._subprocess(argv)
        return self.results[key]

    def _clear_out(self, argv: list[str]) -> None:
        """A command writes a new --out (train's default: runs/main): one left by a rerun is removed."""
        if "--settings" in argv and not _flag(argv, "--out"):  # a run's own settings.toml: it resumes
            return
        out = _flag(argv, "--out") or ("runs/main" if argv[:1] == ["train"] else None)
        path = self.root / out if out else None
        if path is not None and path.is_dir():
            shutil.rmtree(path)
        elif path is not None and path.exists():
            path.unlink()

    def _in_process(self, argv: list[str], capfd) -> tuple[int, str]:
        capfd.readouterr()
        cwd = os.getcwd()
        os.chdir(self.root)
        try:
            code = run_cli(*argv)
        except SystemExit as e:  # --help
            code = e.code
        finally:
            os.chdir(cwd)
            jax.config.update("jax_enable_x64", False)  # --x64 sets it for the process
        out, err = capfd.readouterr()
        return code, out + err

    def _subprocess(self, argv: list[str]) -> tuple[int, str]:
        done = run_meshlm(*argv, cwd=self.root, timeout=600)
        return done.returncode, done.stdout + done.stderr


def run_entry(workspace, text: str, capfd) -> list[tuple[list[str], int, str]]:
    entry = COMMANDS[text]
    for after in entry.after:
        if isinstance(COMMANDS.get(after), Run):
            run_entry(workspace, after, capfd)
        else:
            workspace.run(shlex.split(after)[1:], capfd)
    return [
        (argv, *workspace.run(argv, capfd)) for argv in (argv_of(text, entry, loop) for loop in entry.each)
    ]


def params(texts: list[str], first: dict) -> list:
    """The parametrization of the documented commands ``texts`` (each test id: the page:line that shows
    it first); an entry marked ``slow`` is in the slow tier (the quick test of its code path named)."""
    marks = lambda text: [pytest.mark.slow] if COMMANDS[text].slow else []
    return [pytest.param(text, id=first[text], marks=marks(text)) for text in texts]


def check_entry(workspace: Workspace, text: str, capfd) -> None:
    """Run a documented command line as its entry says; its exit code and expected output asserted, or
    skipped where it is over the docs budget (``costly``: MESHLM_DOCS_ALL=1 runs it)."""
    entry = COMMANDS[text]
    if entry.costly and not os.environ.get("MESHLM_DOCS_ALL"):
        pytest.skip(f"over the budget (MESHLM_DOCS_ALL=1 runs it); its code path: {entry.costly}")
    for argv, code, output in run_entry(workspace, text, capfd):
        assert code == entry.code, f"meshlm {shlex.join(argv)}: exit {code}\n{output[-3000:]}"
        for want in entry.expect:
            assert want in output, f"meshlm {shlex.join(argv)}: no {want!r} in\n{output[-3000:]}"
