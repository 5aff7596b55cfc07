"""Executable docs, the measuring and planning tools: every documented `meshlm bench`, `plan`, `memory`
and `configs` command (README.md, docs/*.md) runs here, with tests/docs_commands.py's substitutions, as
tests/test_docs_commands.py runs the others. They read model presets only, so they run in an empty
directory of their own (a file apart from the workspace of data, tokenizers and checkpoints the other
commands share: the two files run in parallel workers)."""

import pytest
from docs_commands import COMMANDS, Run
from docs_extract import doc_commands
from docs_run import TOOLS, Workspace, check_entry, params

DOCS = doc_commands()
FIRST = {c.text: c.where for c in reversed(DOCS)}  # the page:line that shows a command first: its test id
RUNS = [text for text in dict.fromkeys(c.text for c in DOCS) if isinstance(COMMANDS.get(text), Run)]
RUNS = [text for text in RUNS if text.split()[1] in TOOLS]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return Workspace(tmp_path_factory.mktemp("docs-tools"))


def test_the_tools_have_documented_commands():  # a control: the filter above selects something
    assert {text.split()[1] for text in RUNS} == set(TOOLS)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("text", params(RUNS, FIRST))
def test_documented_tool_command_runs(workspace, text, capfd, children_import_meshlm):
    check_entry(workspace, text, capfd)
