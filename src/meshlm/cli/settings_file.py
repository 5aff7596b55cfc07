"""``--settings FILE``: a command's settings from a TOML file whose keys are its flags' names as
written in Python (``--batch-size 8`` is ``batch_size = 8``, ``--bf16`` is ``compute_dtype =
"bfloat16"``); flags given on the command line override the file.

The file's values become the command's defaults, then the command line is parsed again: so a flag
given there wins (``--no-fsdp`` turns off a file's ``fsdp = true``), and every value is checked as its
flag is (the same ranges and choices). An unknown
key, a value of the wrong type or out of range is one line naming the file, the key and what is valid.
``meshlm train`` writes such a file into its run directory (``settings.toml``).
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from pathlib import Path
from typing import Any

from meshlm.errors import ConfigError

FLAG = "--settings"
NO_FILE = ("launch",)  # runs another command, which takes --settings itself
NOT_SETTINGS = ("help", "settings")  # argparse dests that no file sets


def add_settings_flag(parser: argparse.ArgumentParser) -> None:
    """``--settings`` on every command (the innermost parsers of ``meshlm tokenizer train`` and such)."""
    for name, sub in _subcommands(parser).items():
        if name in NO_FILE:
            continue
        if _subcommands(sub):
            add_settings_flag(sub)
        else:
            sub.add_argument(
                FLAG,
                metavar="FILE",
                default=None,
                help="read settings from this TOML file: keys are the flags' names with _ "
                "(batch_size = 8); flags given here override it",
            )


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser.parse_args(argv)``, with the values of a ``--settings`` file as the command's defaults."""
    argv = sys.argv[1:] if argv is None else list(argv)
    command = _command_parser(parser, argv)
    if command is None:
        return parser.parse_args(argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument(FLAG)
    path = pre.parse_known_args(argv)[0].settings
    if path is None:
        return parser.parse_args(argv)
    values = read_settings(path, command)
    command.set_defaults(**values)
    for action in command._actions:
        if action.dest in values:
            action.required = False  # the file gives it (e.g. generate's --checkpoint)
    return parser.parse_args(argv)


def read_settings(path: str, command: argparse.ArgumentParser) -> dict[str, Any]:
    """The file's values, each checked against its flag of ``command``; one-line errors."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"{FLAG} {path}: cannot read it ({e.strerror}); give a TOML file") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{FLAG} {path}: not a TOML file ({e})") from None
    actions = {a.dest: a for a in command._actions if a.dest not in NOT_SETTINGS}
    for key in data:
        if key not in actions:
            raise ConfigError(f"{FLAG} {path}: unknown setting {key!r}; valid: {', '.join(sorted(actions))}")
    return {key: _value(f"{FLAG} {path}: {key}", actions[key], value) for key, value in data.items()}


SWITCHES = argparse._StoreTrueAction | argparse._StoreFalseAction | argparse.BooleanOptionalAction


def _value(where: str, action: argparse.Action, value: Any) -> Any:
    if isinstance(action, SWITCHES):
        return _of_kind(where, value, bool, "true or false")
    if isinstance(action, argparse._StoreConstAction):  # a switch: --bf16 sets compute_dtype
        kind = type(action.const)
        return _of_kind(where, value, kind, "true or false" if kind is bool else "a string")
    if action.nargs in ("+", "*") or isinstance(action, argparse._AppendAction):
        items = _of_kind(where, value, list, "a list")
        if not items and action.nargs == "+":  # refused as the flag with no value is, not its default
            flag = action.option_strings[0]
            raise ConfigError(
                f"{where} is an empty list, but {flag} takes at least one value; list some, or drop "
                f"the key for the default"
            )
        return [_scalar(where, action, item) for item in items]
    return _scalar(where, action, value)


def _of_kind(where: str, value: Any, kind: type, want: str) -> Any:
    if kind is not bool and isinstance(value, bool) or not isinstance(value, kind):
        raise ConfigError(f"{where} must be {want}, got {value!r}")
    return value


def _scalar(where: str, action: argparse.Action, value: Any) -> Any:
    """One value as its flag's ``type`` reads it: a number stays a number (a string is refused), then
    goes through the same check as the flag's text (ranges). A flag of its own parse (--device-memory
    "80GiB") takes that text, or the number it stands for (bytes)."""
    parse = action.type
    text = str if parse in (None, str) else None  # None: a parse of its own
    kind = {"int": int, "float": float}.get(getattr(parse, "__name__", ""), text)
    if kind is int:
        _of_kind(where, value, int, "an integer")
    elif kind is float:
        _of_kind(where, value, int | float, "a number")
    elif kind is str:
        _of_kind(where, value, str, "a string")
    elif isinstance(value, bool) or not isinstance(value, str | int):
        raise ConfigError(f"{where} must be a string or a number, got {value!r}")
    if parse not in (None, str) and (kind is not None or isinstance(value, str)):
        try:
            value = parse(str(value))
        except (argparse.ArgumentTypeError, ValueError) as e:
            raise ConfigError(f"{where}: {e}") from None
    if action.choices is not None and value not in action.choices:
        raise ConfigError(f"{where} must be one of {', '.join(map(str, action.choices))}, got {value!r}")
    return value


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _command_parser(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser | None:
    """The innermost parser ``argv`` names (``meshlm tokenizer train ...``: tokenizer's train), or None."""
    words = [w for w in argv if not w.startswith("-")]
    found = None
    while (subs := _subcommands(parser)) and words and words[0] in subs and words[0] not in NO_FILE:
        parser = found = subs[words.pop(0)]
    return found if found is not None and not _subcommands(found) else None
