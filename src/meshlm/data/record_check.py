"""Checking records (conversations, preference pairs) before any work: what a bad value is, and every
bad record's location gathered into one error.

A record's location is ``FILE:LINE`` for JSONL (its 1-based line) and ``FILE row N`` for Parquet and
Arrow (its 0-based row). ``Problems`` collects the records that fail a check while every record is
read, and raises one ``DataError`` at the end naming the first in full and where the others are: one
bad conversation among thousands is found from the message alone, and nothing has been tokenized or
written when it is raised.

This module must not import jax: it runs before the CLI has chosen the devices.
"""

from __future__ import annotations

from meshlm.errors import DataError

SHOWN = 5  # locations of further bad records named in the error (the rest counted)


def what(value) -> str:
    """A JSON value as an error names it: its kind and, when short, itself."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, int | float):
        return f"a number ({value!r})"
    if isinstance(value, str):
        return f"a string ({value[:30]!r}{'...' if len(value) > 30 else ''})"
    if isinstance(value, list):
        return f"a list of {len(value)}"
    if isinstance(value, dict):
        keys = ", ".join(map(str, list(value)[:6]))
        return f"an object (fields: {keys})" if keys else "an empty object"
    return type(value).__name__


class Problems:
    """Bad records, by location, raised together by ``check`` (the module doc)."""

    def __init__(self, kind: str):
        self.kind = kind  # what the records are, plural ("conversations", "preference pairs")
        self.found: list[tuple[str, str]] = []  # (where, what is wrong)
        self.seen = 0

    def add(self, where: str, problem: str) -> None:
        self.found.append((where, problem))

    def check(self) -> None:
        """One DataError for every bad record found (the first in full), or nothing."""
        if not self.found:
            return
        where, problem = self.found[0]
        line = f"{where}: {problem}"
        rest = [w for w, _ in self.found[1:]]
        if rest:
            shown = ", ".join(rest[:SHOWN]) + (f" and {len(rest) - SHOWN} more" if len(rest) > SHOWN else "")
            line += f" ({len(self.found)} of {self.seen} {self.kind} are bad; the others: {shown})"
        raise DataError(line)
