"""The ``meshlm`` command line. Each subcommand lives in ``meshlm.cli.<name>``: ``add_parser(sub)``
registers it and a short ``run(args)`` builds configs and calls the library. User errors print one
line and exit 2.

No module of this package may import JAX at module level: every parser is built before ``--devices``
sets ``XLA_FLAGS``. Each ``run`` calls ``meshlm.cli.common.setup(args)`` first, then imports what it
needs. Nothing in the library imports ``meshlm.cli``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import warnings
from typing import NoReturn

from meshlm.cli import (
    bench,
    configs,
    convert,
    data,
    evaluate,
    generate,
    launch,
    memory,
    plan,
    settings_file,
    tokenizer,
    train,
    verify,
)
from meshlm.errors import Interrupted, MeshlmError, is_disk_full

COMMANDS = [train, verify, generate, evaluate, convert, launch, bench, memory, plan, tokenizer, data, configs]


class OneLineParser(argparse.ArgumentParser):
    """A bad flag is one line, exit 2: ``meshlm train: error: argument --lr: ... (see meshlm train
    --help)``, not argparse's usage block (6-22 lines) before it. Subcommands' parsers are of this
    class too (``add_subparsers`` makes its parent's class)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        """As argparse's, with an unknown flag blamed on the subcommand it was given to (argparse
        reports it from the top parser: ``meshlm: error: unrecognized arguments``)."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            names = (getattr(parsed, "command", None), getattr(parsed, "action", None))
            prog = " ".join([self.prog, *filter(None, names)])
            self.exit(2, f"{prog}: error: unrecognized arguments: {' '.join(extras)} (see {prog} --help)\n")
        return parsed


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="meshlm",
        description="Model-parallel LM training in JAX + Haiku, proven equal to the unsharded model.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    settings_file.add_settings_flag(parser)
    return parser


def user_warning(message, category, filename, lineno, line=None) -> str:
    """Warnings as the command line shows them: one line, ``meshlm: warning: ...``; no source file,
    line number or quoted code (those are for library users' tracebacks, not for a run's log)."""
    return f"meshlm: warning: {message}\n"


def main(argv: list[str] | None = None) -> int:
    shown, warnings.formatwarning = warnings.formatwarning, user_warning
    try:
        args = settings_file.parse_args(build_parser(), argv)  # a --settings file's values, then the flags
        if args.fn.__module__ in WRITE_NOTHING and argv is None:  # the command line, not in-process callers
            signal.signal(signal.SIGINT, _stop_at_once)
        code = args.fn(args)
    except MeshlmError as e:
        print(f"meshlm: error: {e}", file=sys.stderr)
        code = 2
    except OSError as e:
        if not is_disk_full(e):
            raise  # a bug: its traceback is wanted
        where = f" writing {e.filename}" if e.filename else ""
        print(
            f"meshlm: error: no space left on device{where}; free space (or choose another --out), "
            "then run the same command again",
            file=sys.stderr,
        )
        code = 2
    except Interrupted as e:  # train, before its first step: one line, 128 + the signal
        print(f"meshlm: {e}", file=sys.stderr)
        code = e.code
    except KeyboardInterrupt:  # Ctrl-C in any other command: it stops, and says so in one line
        _leave_interrupted()
    finally:
        warnings.formatwarning = shown  # in-process callers (tests) keep their own format
    return _exit_code(code)


# Commands that write no file: Ctrl-C stops them at once, from the signal handler itself. A
# KeyboardInterrupt raised instead can be swallowed by a library's bare ``except:`` (one run in CI went on
# to exit 0 after a SIGINT sent while JAX was starting). train (safe points), data and tokenizer (their
# unfinished outputs named), convert and launch keep the KeyboardInterrupt path.
WRITE_NOTHING = frozenset(m.__name__ for m in (verify, generate, evaluate, bench, memory, plan, configs))


def _stop_at_once(signum, frame) -> NoReturn:
    _leave_interrupted()


def _leave_interrupted() -> NoReturn:
    """Exit 130 at once. The KeyboardInterrupt may have left JAX mid-compile, with XLA's threads
    still running: the interpreter's teardown then crashed (a segmentation fault) now and then."""
    print("meshlm: SIGINT: stopped", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(128 + signal.SIGINT)


def _exit_code(code: int) -> int:
    """In a multi-process job, a failing process must not wait at JAX's shutdown barrier for peers
    that are stuck waiting for it: leave at once (``distributed.exit_process``). An interrupted run
    (128 + SIGINT/SIGTERM) is no failure: every process stopped and saved at the same step, so all
    leave through the barrier together."""
    from meshlm.parallel.launch import INTERRUPTED_CODES

    if code and code not in INTERRUPTED_CODES and "jax" in sys.modules:
        import jax

        if jax.process_count() > 1:
            from meshlm.parallel.distributed import exit_process

            exit_process(code)
    return code
