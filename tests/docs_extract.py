"""Every `meshlm ...` command the docs show: in ``` blocks (a line, with its `\\` continuations) and in
inline `code` spans (which may wrap over lines). Shared by tests/test_docs_commands.py and its table."""

import pathlib
import re
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# `meshlm SUB` at the start of a command: after a line start, a space, `$ `, `.venv/bin/` or a shell
# separator; SUB a lower-case word not followed by ":" (that is a report's first line, not a command).
_START = re.compile(r"(?:^|(?<=[\s;&|]))(?:\.venv/bin/)?meshlm (?=[a-z])")
_END = re.compile(r"\s+#\s|\s*(?:\|\||&&|;|\|(?![a-z0-9])|$)")


@dataclass(frozen=True)
class DocCommand:
    text: str  # the command as the docs write it: one line, no prompt, prefix or trailing comment
    where: str  # page:line of its first occurrence
    inline: bool  # from an inline `code` span (prose), not a ``` block


def _command_at(line: str, start: int) -> str | None:
    rest = line[start:].removeprefix(".venv/bin/")
    first = rest.split(" ", 2)[1] if " " in rest else ""
    if re.fullmatch(r"[a-z]+:.*", first) or not re.match(r"[a-z]", first):
        return None
    end = _END.search(rest, len("meshlm ") + len(first))
    return re.sub(r"\s+", " ", rest[: end.start()]).strip()


def _commands_in(text: str) -> list[str]:
    out = []
    for match in _START.finditer(text):
        command = _command_at(text, match.start())
        if command:
            out.append(command)
    return out


def _block_lines(lines: list[str]):
    """(line number, logical line) for each line inside ``` blocks, `\\` continuations joined."""
    in_code, pending, first = False, "", 0
    for number, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            in_code = not in_code
            continue
        if not in_code:
            continue
        if not pending:
            first = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield first, pending + line
        pending = ""


def _prose(lines: list[str]) -> str:
    """The page with its ``` blocks blanked (line numbers kept)."""
    in_code, out = False, []
    for line in lines:
        fence = line.lstrip().startswith("```")
        in_code = in_code != fence if fence else in_code
        out.append("" if in_code or fence else line)
    return "\n".join(out)


def page_commands(page: pathlib.Path) -> list[DocCommand]:
    lines = page.read_text().splitlines()
    found = []
    for number, line in _block_lines(lines):
        found += [DocCommand(c, f"{page.name}:{number}", False) for c in _commands_in(line)]
    prose = _prose(lines)
    for span in re.finditer(r"`([^`]+)`", prose):
        number = prose.count("\n", 0, span.start()) + 1
        text = span.group(1).replace("\n", " ")
        found += [DocCommand(c, f"{page.name}:{number}", True) for c in _commands_in(text)]
    return found


def doc_commands() -> list[DocCommand]:
    """Every occurrence, page by page."""
    return [command for page in PAGES for command in page_commands(page)]


def python_blocks(page: pathlib.Path) -> list[str]:
    """The ```python blocks of ``page``, each as written."""
    return re.findall(r"^```python\n(.*?)^```$", page.read_text(), flags=re.S | re.M)
