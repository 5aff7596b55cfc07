"""meshlm tokenizer train: a byte-level BPE (Hugging Face ``tokenizers``) written as tokenizer.json.

All 256 bytes are in its alphabet (no unknown tokens; any UTF-8 text round-trips exactly) and its id 0
is the end-of-document token ``<|endoftext|>``. Use it with ``meshlm train --tokenizer PATH``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from meshlm.cli.common import positive_int
from meshlm.errors import ConfigError


def add_parser(sub) -> None:
    p = sub.add_parser("tokenizer", help="train a byte-level BPE tokenizer (tokenizer.json)")
    actions = p.add_subparsers(dest="action", required=True)
    t = actions.add_parser("train", help="train a byte-level BPE on text files; writes tokenizer.json")
    t.add_argument(
        "--data",
        nargs="+",
        default=None,
        help="text, JSONL or Parquet files, directories or globs (default: the stdlib)",
    )
    t.add_argument(
        "--text-field", default="text", help="the text field of JSONL / Parquet rows (default text)"
    )
    t.add_argument("--vocab-size", type=positive_int, required=True, help="ids, the 257 base ones included")
    t.add_argument("--out", required=True, help="tokenizer.json to write (a directory: DIR/tokenizer.json)")
    t.add_argument("--json", action="store_true", help="print the summary as JSON")
    t.set_defaults(fn=run)


def _out_path(out: str) -> Path:
    path = Path(out)
    path = path / "tokenizer.json" if path.is_dir() else path
    if path.exists():
        raise ConfigError(f"--out {path} exists; choose a new path or remove it")
    if not path.parent.is_dir():
        raise ConfigError(f"--out {path}: directory {path.parent} does not exist; create it first")
    return path


def run(args) -> int:
    from meshlm.data.bpe import check_vocab_size, train_bpe
    from meshlm.data.corpus import corpus_documents

    check_vocab_size(args.vocab_size)  # bad input fails before the corpus is read
    out = _out_path(args.out)
    t0 = time.perf_counter()
    texts = [d.decode("utf-8", errors="replace") for d in corpus_documents(args.data, args.text_field)]
    tok = train_bpe(texts, args.vocab_size, length=len(texts))
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(tok.to_json(), encoding="utf-8")
    tmp.replace(out)
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    n_tokens = sum(len(ids) for ids in tok.encode_batch(texts))
    summary = {
        "out": str(out),
        "vocab_size": tok.vocab_size,
        "documents": len(texts),  # a text file is one, a JSONL / Parquet row one
        "bytes": n_bytes,
        "bytes_per_token": n_bytes / max(1, n_tokens),
        "fingerprint": tok.fingerprint,
        "seconds": time.perf_counter() - t0,
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(
            f"trained a {tok.vocab_size}-id byte-level BPE on {n_bytes:,} bytes in {len(texts)} documents "
            f"({summary['bytes_per_token']:.2f} bytes/token on them) in {summary['seconds']:.1f} s: {out}",
            file=sys.stderr,
        )
    return 0
