"""meshlm data prepare: tokenize a corpus once into a memory-mapped token store for ``train --data DIR``.

The corpus is split into train and validation exactly as ``train --data PATHS`` splits it, and each
document is tokenized as the loader would: training on the store sees the same tokens, without
reading the corpus into memory. See ``meshlm.data.store`` for the directory's layout.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import time
from pathlib import Path

from meshlm.cli.common import arg_type, non_negative_int, positive_int
from meshlm.data.chat import TRAIN_ON
from meshlm.data.chat_store import OVERLONG
from meshlm.ranges import STORE_SEQ_LEN, Range

VAL_FRACTION = Range(float, 0.0, 1.0, low_open=True, high_open=True)  # data.sources.check_fraction's


def add_parser(sub) -> None:
    p = sub.add_parser("data", help="prepare a memory-mapped token store for train --data DIR")
    actions = p.add_subparsers(dest="action", required=True)
    t = actions.add_parser("prepare", help="tokenize text files once into a token store directory")
    t.add_argument(
        "--data",
        nargs="+",
        default=None,
        help="text, .jsonl(.gz/.zst), .parquet or .arrow files, directories (also a datasets save_to_disk "
        "directory) or globs (default: the stdlib)",
    )
    t.add_argument(
        "--text-field",
        default=None,
        help="the field holding the text in JSONL / Parquet / saved-dataset rows (default: text)",
    )
    t.add_argument(
        "--tokenizer", default="bytes", help="a tokenizer.json, a directory holding one, or 'bytes' (default)"
    )
    t.add_argument("--out", required=True, help="the store directory to write: new or empty")
    t.add_argument(
        "--val-fraction",
        type=arg_type(VAL_FRACTION),
        default=None,
        help=f"validation share, {VAL_FRACTION.describe()}, by file as train --data splits (default 0.05, "
        "train's)",
    )
    t.add_argument(
        "--max-bytes", type=positive_int, default=None, help="cap the corpus at about this many bytes"
    )
    t.add_argument(
        "--workers", type=non_negative_int, default=None, help="tokenizing processes (0: one per CPU)"
    )
    t.add_argument("--json", action="store_true", help="print the summary as JSON")
    c = t.add_argument_group("chat SFT (--chat: conversations to tokens and a loss mask, packed)")
    c.add_argument(
        "--chat",
        action="store_true",
        help="--data holds conversations (`messages`, or `prompt` and `completion`); render them with "
        "--tokenizer DIR's chat template and store a loss mask",
    )
    c.add_argument("--chat-template", default=None, help="a Jinja chat template file (default: DIR's own)")
    c.add_argument(
        "--pairs",
        action="store_true",
        help="--data holds preference pairs (prompt, chosen, rejected) for `train --objective dpo`: "
        "rendered with --tokenizer DIR's chat template if it has one, else prompt + completion + EOD",
    )
    c.add_argument(
        "--train-on",
        choices=TRAIN_ON,
        default=None,
        help="the tokens the loss counts: assistant turns (default), all, or the last assistant turn",
    )
    c.add_argument(
        "--seq-len",
        type=arg_type(STORE_SEQ_LEN),
        default=None,
        help="--chat, --pairs: tokens per row (train's --seq-len)",
    )
    c.add_argument(
        "--overlong",
        choices=OVERLONG,
        default=None,
        help="--chat: a conversation longer than a row is dropped (default) or truncated; both counted",
    )
    t.set_defaults(fn=run)


# The flags of each kind of data (``check_flags``); --data, --tokenizer, --out and --json are every kind's.
KINDS = ("text", "chat", "pairs")
ONLY = {
    "text_field": ("text",),
    "max_bytes": ("text",),
    "workers": ("text",),
    "val_fraction": ("text", "chat"),  # pairs: about 10% by record (``data.pairs.VAL_FRACTION``)
    "seq_len": ("chat", "pairs"),
    "chat_template": ("chat",),
    "train_on": ("chat",),
    "overlong": ("chat",),
}
DEFAULTS = {
    "text_field": "text",
    "workers": 0,
    "val_fraction": 0.05,
    "train_on": "assistant",
    "overlong": "drop",
}


def check_flags(args) -> None:
    """A flag given for a kind of data it does not apply to is one error (never silently ignored);
    then the defaults of those not given are filled in."""
    from meshlm.errors import ConfigError

    if args.chat and args.pairs:
        raise ConfigError(
            "--chat and --pairs are two kinds of data: --chat for conversations (SFT), --pairs for "
            "preference pairs (DPO); pass one"
        )
    kind = "pairs" if args.pairs else "chat" if args.chat else "text"
    for name, kinds in ONLY.items():
        if getattr(args, name) is not None and kind not in kinds:
            raise ConfigError(f"--{name.replace('_', '-')} {_applies(kinds)}, not to {_data(kind)}; drop it")
        if getattr(args, name) is None and name in DEFAULTS:
            setattr(args, name, DEFAULTS[name])


def _data(kind: str) -> str:
    return "a text corpus (no --chat, no --pairs)" if kind == "text" else f"--{kind} data"


def _applies(kinds) -> str:
    return "applies to " + " and ".join(map(_data, kinds))


def read_tokenizer(spec):
    """--tokenizer with the files it comes with: a checkpoint's checked against the SHA-256s its meta
    records (``train.tokenizers.tokenizer_at``, as train, generate and convert read it; JAX is imported
    only then), else a tokenizer.json or a directory holding one."""
    from meshlm.data.tokenizer_files import checkpoint_of, directory_tokenizer

    if checkpoint_of(spec) is not None:
        from meshlm.train.tokenizers import tokenizer_at

        return tokenizer_at(spec)
    return directory_tokenizer(spec)


def run(args) -> int:
    from meshlm.data.prepare import check_out, plan, prepare
    from meshlm.data.records import Skipped
    from meshlm.io.run_lock import LOCK_FILE, check_free, lock_new_dir

    # Bad input fails before any work: the output, the tokenizer, the corpus. A live prepare's
    # store is not "interrupted" nor its lock "not empty": its owner is named.
    check_free(Path(args.out))
    check_out(args.out, ignore=(LOCK_FILE,))
    check_flags(args)
    if args.pairs:
        return run_pairs(args)
    if args.chat:
        return run_chat(args)
    tok = read_tokenizer(args.tokenizer)
    plan(args.data, args.val_fraction, args.max_bytes, args.text_field)
    t0 = time.perf_counter()
    made = not Path(args.out).exists()
    lock = lock_new_dir(Path(args.out), multi_process=False)  # one prepare per --out
    try:
        index = prepare(
            args.data,
            tok,
            args.out,
            val_fraction=args.val_fraction,
            max_bytes=args.max_bytes,
            workers=args.workers,
            text_field=args.text_field,
        )
    except KeyboardInterrupt:
        # No JAX here: a normal exit (not the CLI's immediate one), so that the pool's semaphores
        # are released, not reported leaked by multiprocessing's resource tracker.
        print(
            f"meshlm: SIGINT: stopped; {args.out} holds an unfinished store (no index.json): remove it "
            "and rerun",
            file=sys.stderr,
        )
        return 128 + signal.SIGINT
    except Exception:
        lock.release()
        if made:  # prepare removed what it wrote; the directory held the lock too
            with contextlib.suppress(OSError):
                Path(args.out).rmdir()
        raise
    finally:
        lock.release()
    splits = index["splits"]
    summary = {
        "out": args.out,
        "tokenizer": tok.describe(),
        "dtype": index["dtype"],
        **{f"{s}_{k}": splits[s][k] for s in ("train", "val") for k in ("tokens", "bytes")},
        **{f"{s}_documents": sum(d.get("rows", 1) for d in splits[s]["documents"]) for s in ("train", "val")},
        "skipped_rows": index["skipped_rows"],
        "seconds": round(time.perf_counter() - t0, 2),
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(
            f"prepared {summary['train_tokens']:,} train + {summary['val_tokens']:,} validation tokens "
            f"({index['dtype']}) of {summary['train_bytes'] + summary['val_bytes']:,} bytes with the "
            f"{tok.describe()} in {summary['seconds']:.1f} s: {args.out}",
            file=sys.stderr,
        )
        if index["skipped_rows"]:
            print(Skipped(index["skipped_rows"]).describe(args.text_field), file=sys.stderr)
    return 0


def run_chat(args) -> int:
    """``data prepare --chat``: bad input (tokenizer, template, --seq-len, files) fails before work."""
    from meshlm.data.chat_store import load_template, prepare_chat
    from meshlm.errors import DataError
    from meshlm.io.run_lock import lock_new_dir

    if args.seq_len is None:
        raise DataError(
            "--chat packs conversations into rows: pass --seq-len (the --seq-len you will train with)"
        )
    if not args.data:
        raise DataError("--chat needs --data: JSONL or Parquet files of conversations")
    missing = [p for p in args.data if not Path(p).is_file()]
    if missing:
        raise DataError(f"--data {missing[0]}: no such file; --chat takes conversation files")
    template = load_template(read_tokenizer(args.tokenizer), args.chat_template)
    t0 = time.perf_counter()
    made = not Path(args.out).exists()
    lock = lock_new_dir(Path(args.out), multi_process=False)
    try:
        index = prepare_chat(
            args.data,
            template,
            Path(args.out),
            seq_len=args.seq_len,
            train_on=args.train_on,
            val_fraction=args.val_fraction,
            overlong=args.overlong,
        )
    except Exception:
        lock.release()
        if made:
            import shutil

            shutil.rmtree(args.out, ignore_errors=True)
        raise
    lock.release()
    keys = ("conversations", "dropped", "truncated", "tokens", "masked_tokens")
    summary = {"out": args.out, **{f"{s}_{k}": index["splits"][s][k] for s in ("train", "val") for k in keys}}
    summary["seconds"] = round(time.perf_counter() - t0, 2)
    if args.json:
        print(json.dumps(summary))
    else:
        tr = {k: summary[f"train_{k}"] for k in keys}
        print(
            f"prepared {tr['conversations']} + {summary['val_conversations']} conversations "
            f"({tr['tokens']:,} train tokens in rows of {args.seq_len + 1}, {tr['masked_tokens']:,} trained "
            f"on: {args.train_on}); dropped {tr['dropped'] + summary['val_dropped']}, truncated "
            f"{tr['truncated'] + summary['val_truncated']} longer than a row ({args.overlong}): {args.out}",
            file=sys.stderr,
        )
    return 0


def run_pairs(args) -> int:
    """``data prepare --pairs`` (``data.pair_store``): bad input fails before work."""
    from meshlm.data.pair_store import prepare_pairs
    from meshlm.data.pairs import renderer_for
    from meshlm.errors import DataError

    if args.seq_len is None or not args.data:
        raise DataError(
            "--pairs needs --data (files of pairs) and --seq-len (the --seq-len you will train with)"
        )
    render = renderer_for(read_tokenizer(args.tokenizer))
    index = prepare_pairs(args.data, render, Path(args.out), args.seq_len)
    train, val = (index["splits"][s]["pairs"] for s in ("train", "val"))
    if args.json:
        print(
            json.dumps({"out": args.out, "train_pairs": train, "val_pairs": val, "dropped": index["dropped"]})
        )
        return 0
    print(
        f"prepared {train} + {val} pairs ({index['dropped']} dropped: longer than --seq-len "
        f"{args.seq_len}), rendered as {render.rule}: {args.out}",
        file=sys.stderr,
    )
    return 0
