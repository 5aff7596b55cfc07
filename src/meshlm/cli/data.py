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
from meshlm.ranges import Range

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
        default="text",
        help="the field holding the text in JSONL / Parquet / saved-dataset rows (default: text)",
    )
    t.add_argument(
        "--tokenizer", default="bytes", help="a tokenizer.json, a directory holding one, or 'bytes' (default)"
    )
    t.add_argument("--out", required=True, help="the store directory to write: new or empty")
    t.add_argument(
        "--val-fraction",
        type=arg_type(VAL_FRACTION),
        default=0.05,
        help=f"validation share, {VAL_FRACTION.describe()}, by file as train --data splits (default 0.05, "
        "train's)",
    )
    t.add_argument(
        "--max-bytes", type=positive_int, default=None, help="cap the corpus at about this many bytes"
    )
    t.add_argument(
        "--workers", type=non_negative_int, default=0, help="tokenizing processes (0: one per CPU)"
    )
    t.add_argument("--json", action="store_true", help="print the summary as JSON")
    t.set_defaults(fn=run)


def run(args) -> int:
    from meshlm.data.prepare import check_out, plan, prepare
    from meshlm.data.records import Skipped
    from meshlm.data.tokenizer import load_tokenizer
    from meshlm.io.run_lock import LOCK_FILE, check_free, lock_new_dir

    # Bad input fails before any work: the output, the tokenizer, the corpus. A live prepare's
    # store is not "interrupted" nor its lock "not empty": its owner is named.
    check_free(Path(args.out))
    check_out(args.out, ignore=(LOCK_FILE,))
    tok = load_tokenizer(args.tokenizer)
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
