"""Executable docs: every `meshlm ...` command of README.md and docs/*.md is run here, with the tiny
substitutions tests/docs_commands.py declares next to it, or is marked there as shown only, with the
reason. A command the docs gain without an entry fails, and so does an entry no page has any more.

The commands run in this process (``meshlm.cli.main``: one JAX, its 8 fake devices; a command's
--devices is then moot where it names its --mesh) in one workspace directory whose inputs the
``workspace`` fixture writes; a command that needs more than 8 devices runs in a subprocess. Commands
that are the same after substitution run once; a command's ``after`` (say, the main job whose runs/main
generate reads) runs first, once. A proof (``meshlm verify``: 20-60 s of CPU each) is run only with
MESHLM_DOCS_ALL=1 where its entry names the test that proves its code path: all of them would add
~15 minutes to the suite.
"""

import gzip
import json
import os
import shutil
from pathlib import Path

import jax
import pytest
from docs_commands import COMMANDS, Run, Shown
from docs_extract import ROOT, doc_commands, page_commands, python_blocks
from docs_run import TOOLS, Workspace, check_entry, params, run_entry
from helpers import TEXT, run_cli, write_corpus
from test_chat_sft import chat_tokenizer_dir

DOCS = doc_commands()
FIRST = {c.text: c.where for c in reversed(DOCS)}  # the page:line that shows a command first: its test id
RUNS = [text for text in dict.fromkeys(c.text for c in DOCS) if isinstance(COMMANDS.get(text), Run)]
# The measuring and planning tools' commands (bench, plan, memory, configs) read presets only: they run
# in tests/test_docs_tool_commands.py, without this file's workspace of inputs.
RUNS = [text for text in RUNS if text.split()[1] not in TOOLS]


def test_every_documented_command_is_run_or_shown():
    missing = sorted({f"{c.where}: {c.text}" for c in DOCS if c.text not in COMMANDS})
    assert not missing, "add each to tests/docs_commands.py (run, or shown with a reason):\n" + "\n".join(
        missing
    )


def test_extraction_of_blocks_and_inline_spans(tmp_path):
    page = tmp_path / "p.md"
    page.write_text(
        "Run `meshlm plan --config cpu\n--mesh 1x1` here, not `meshlm.cli`.\n\n  ```bash\n"
        ".venv/bin/meshlm verify --mesh 2x2 \\\n    --x64   # float64\n"
        "$ meshlm eval --json | head -1\nmeshlm verify: config=seed (a report)\n"
        "for s in a b; do meshlm train --x $s; done\n  ```\n"
    )
    assert [(c.text, c.where, c.inline) for c in page_commands(page)] == [
        ("meshlm verify --mesh 2x2 --x64", "p.md:5", False),
        ("meshlm eval --json", "p.md:7", False),
        ("meshlm train --x $s", "p.md:9", False),
        ("meshlm plan --config cpu --mesh 1x1", "p.md:1", True),
    ]


def test_every_entry_is_still_documented():
    documented = {c.text for c in DOCS}
    stale = [text for text in COMMANDS if text not in documented]
    assert not stale, f"no page shows these any more; drop them from tests/docs_commands.py: {stale}"


def test_shown_only_says_why_and_substitutions_apply():
    for text, entry in COMMANDS.items():
        if isinstance(entry, Shown):
            assert len(entry.why) > 20, text
            continue
        for old, _ in entry.subs:
            assert old in text, f"{text!r}: the substitution {old!r} is not in the command"
        for after in entry.after:
            assert after.startswith("meshlm "), after
        for path in filter(None, (entry.costly, entry.slow)):  # the quick test of its code path exists
            _check_pointer(path)


def _check_pointer(path: str) -> None:
    """``path`` names a test file, a test in it, or a documented command's test by its page:line id: that
    command's entry must then be run in the quick tier (line numbers move as the docs change)."""
    file, _, test = path.partition("::")
    assert os.path.exists(ROOT / file), path
    name, _, where = test.partition("[")
    assert not name or f"def {name}(" in (ROOT / file).read_text(), path
    if where and file.startswith("tests/test_docs"):
        texts = [text for text, first in FIRST.items() if first == where[:-1]]
        assert len(texts) == 1, f"{path}: no documented command is first shown at {where[:-1]}"
        entry = COMMANDS[texts[0]]
        assert isinstance(entry, Run) and not entry.slow and not entry.costly, f"{path} is not quick"


def _hf_llama(directory: Path) -> None:
    """A tiny random Llama with its own BPE tokenizer (300 ids, 320 rows), as transformers saves it."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from meshlm.data.bpe import train_bpe
    from meshlm.data.hf_tokenizer import EOD_TOKEN

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(directory)
    bpe = train_bpe([TEXT, "import os\nclass A:\n    pass\n" * 20], 300)
    transformers.PreTrainedTokenizerFast(tokenizer_object=bpe.tok, eos_token=EOD_TOKEN).save_pretrained(
        directory
    )


def _hf_qwen3_chat(directory: Path, template: str) -> None:
    """A tiny random Qwen3 (320 rows, tied embeddings) with the chat tests' ChatML tokenizer, as
    transformers saves it: docs/finetuning.md's ``qwen3-tiny``."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    chat_tokenizer_dir(directory, template)
    tok = transformers.AutoTokenizer.from_pretrained(directory)
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=320, hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=True,
        bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(directory)


def _bw_checkpoint(path: Path) -> None:
    """docs/proof.md's snippet: a tiny-llama checkpoint whose config has blockwise attention."""
    import haiku as hk
    import jax.numpy as jnp

    from meshlm.io.model_io import save_model
    from meshlm.model.config import get_config
    from meshlm.model.transformer import loss_fn
    from meshlm.parallel.context import Parallel

    cfg = get_config("tiny-llama").replace(attention="blockwise", attn_block=16)
    batch = {k: jnp.zeros((1, 8), jnp.int32) for k in ("inputs", "targets")}
    save_model(str(path), cfg, hk.transform(loss_fn(cfg, Parallel())).init(jax.random.PRNGKey(0), batch))


def _records(root: Path) -> None:
    """The corpora docs/data.md names: Parquet shards, JSONL (.gz, .zst), a saved dataset."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    texts = [TEXT[: 200 + 37 * i] + f" #{i}" for i in range(40)]
    (root / "shards").mkdir()
    for k in range(2):
        pq.write_table(pa.table({"content": texts[k::2]}), root / "shards" / f"{k}.parquet")
    rows = "".join(json.dumps({"text": t, "body": t}) + "\n" for t in texts).encode()
    (root / "notes.jsonl.gz").write_bytes(gzip.compress(rows))
    (root / "dump.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(rows))
    (root / "wiki.test.jsonl").write_bytes(rows)
    (root / "docs").mkdir()
    (root / "docs" / "notes.jsonl").write_bytes(rows)
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(root / "my_dataset"))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """Every input the docs' commands name, small: text, records, tokenizers, a Hugging Face model."""
    root = tmp_path_factory.mktemp("docs")
    write_corpus((root / "code").mkdir() or root / "code")
    (root / "my.txt").write_text(TEXT)
    for d in ("corpus/a", "corpus/b", "held_out"):
        (root / d).mkdir(parents=True)
    (root / "corpus/a/one.txt").write_text(TEXT)
    (root / "corpus/b/two.txt").write_text(TEXT.upper())
    (root / "held_out/x.py").write_text(TEXT[:3000])
    _records(root)
    shutil.copytree(ROOT / "examples" / "chat", root / "examples" / "chat")  # the chat SFT section's
    shutil.copytree(ROOT / "examples" / "dpo", root / "examples" / "dpo")  # the DPO section's pairs
    chat_tokenizer_dir(root / "chat-tokenizer", (ROOT / "examples/chat/chatml.jinja").read_text())
    _hf_qwen3_chat(root / "qwen3-tiny", (ROOT / "examples/chat/chatml.jinja").read_text())  # finetuning.md
    for page in (ROOT / "docs").glob("*.md"):
        shutil.copy(page, root / "docs" / page.name)
    cwd = os.getcwd()
    os.chdir(root)
    try:
        assert (
            run_cli("tokenizer", "train", "--data", "my.txt", "--vocab-size", "300", "--out", "tok.json") == 0
        )
    finally:
        os.chdir(cwd)
    (root / "tok").mkdir()
    shutil.copy(root / "tok.json", root / "tok" / "tokenizer.json")
    _hf_llama(root / "path/to/hf-model")
    shutil.copytree(root / "path/to/hf-model", root / "HF_DIR")
    (root / "hf").mkdir()
    shutil.copy(root / "HF_DIR/tokenizer.json", root / "hf/tokenizer.json")
    assert (
        run_cli("convert", "--from-hf", str(root / "HF_DIR"), "--out", str(root / "runs/llama-import")) == 0
    )
    _bw_checkpoint(root / "bw-ckpt")
    return Workspace(root)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("text", params(RUNS, FIRST))
def test_documented_command_runs(workspace, text, capfd, children_import_meshlm):
    check_entry(workspace, text, capfd)


@pytest.mark.filterwarnings("ignore")
def test_finetuning_python_loads_the_peft_export_in_transformers_and_chats(workspace, capfd):
    """docs/finetuning.md's Python, as written, in the workspace after the walk-through's step 4: peft
    loads the export onto the transformers model (its trained adapters, B != 0) and generates."""
    peft = pytest.importorskip("peft")
    export = "meshlm convert --to-peft runs/qwen3-lora --out runs/qwen3-peft"
    assert all(code == 0 for _, code, _ in run_entry(workspace, export, capfd))
    (block,) = python_blocks(ROOT / "docs" / "finetuning.md")
    names: dict = {}
    cwd = os.getcwd()
    os.chdir(workspace.root)
    try:
        capfd.readouterr()
        exec(compile(block, "docs/finetuning.md", "exec"), names)
    finally:
        os.chdir(cwd)
    model, ids = names["model"], names["ids"]
    assert isinstance(model, peft.PeftModel) and ids.shape[0] == 1
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert len(lora_b) == 14 and all(float(p.abs().max()) > 0 for p in lora_b)  # 7 targets x 2 layers
    assert capfd.readouterr().out.endswith("\n")  # the decoded reply, printed
