"""The README is the front door and docs/ holds the rest: every relative link must lead somewhere."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: pathlib.Path) -> set[str]:
    lines = page.read_text().splitlines()
    in_code = False
    out = set()
    for line in lines:
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            out.add(_slug(line.lstrip("#")))
    return out


def _links(page: pathlib.Path):
    for target in LINK.findall(page.read_text()):
        if not re.match(r"[a-z]+://", target):
            yield target


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no heading)")
    assert not broken, f"{page.name}: broken links {broken}"


def test_link_checker_catches_a_broken_link(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# Title\n\nsee [a](p.md#title), [b](p.md#nope), [c](missing.md)\n")
    assert list(_links(page)) == ["p.md#title", "p.md#nope", "missing.md"]
    assert _anchors(page) == {"title"}


def test_readme_is_the_front_door():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 200, "README.md: keep it the front door; move detail into docs/"
    for command in ("pip install -e . && .venv/bin/meshlm train", "pip install -e '.[test]'"):
        assert command in readme, f"the set-up command with {command!r} is missing"
